package tessera

import (
	"context"
	"errors"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"
	"k8s.io/kubernetes/pkg/scheduler/apis/config"
)

// fakeHandle is the part of kube-scheduler's framework Bind and PreBind use.
type fakeHandle struct {
	fwk.Handle
	cs        kubernetes.Interface
	bind      []string // the profile's bind plugins, in order
	activated []string // pods PostFilter sent back to the active queue
}

func (h *fakeHandle) ClientSet() kubernetes.Interface { return h.cs }

func (h *fakeHandle) Activate(_ klog.Logger, pods map[string]*v1.Pod) {
	for k := range pods {
		h.activated = append(h.activated, k)
	}
}

func (h *fakeHandle) ListPlugins() *config.Plugins {
	var ps []config.Plugin
	for _, n := range h.bind {
		ps = append(ps, config.Plugin{Name: n})
	}
	return &config.Plugins{Bind: config.PluginSet{Enabled: ps}}
}

// bindings records every pods/binding create; fail makes them fail.
func bindings(cs *fake.Clientset, fail error) *[]*v1.Binding {
	var got []*v1.Binding
	cs.PrependReactor("create", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if a.GetSubresource() != "binding" {
			return false, nil, nil
		}
		got = append(got, a.(k8stesting.CreateAction).GetObject().(*v1.Binding))
		return true, nil, fail
	})
	return &got
}

func TestBindCarriesTheHandedOverAnnotationsInOneBinding(t *testing.T) {
	fake_, p := startFake(t, nil)
	cs := fake.NewClientset()
	got := bindings(cs, nil)
	p.handle = &fakeHandle{cs: cs, bind: []string{Name, "DefaultBinder"}}
	pod := makePod("p").gpu("1").obj()
	ctx := context.Background()
	state := decided(t, fake_, p)

	if st := p.PreBind(ctx, state, pod, "n1"); !st.IsSuccess() {
		t.Fatalf("PreBind = %v", st)
	}
	if _, _, _, r := fake_.last(); !r.GetHandOver() {
		t.Errorf("PreBindRequest.hand_over = false, want true (Tessera binds first)")
	}
	if st := p.Bind(ctx, state, pod, "n1"); !st.IsSuccess() {
		t.Fatalf("Bind = %v", st)
	}
	if len(*got) != 1 {
		t.Fatalf("bindings = %d, want 1", len(*got))
	}
	b := (*got)[0]
	if b.Name != "p" || b.UID != pod.UID || b.Target.Kind != "Node" || b.Target.Name != "n1" ||
		b.Annotations["hami.io/vgpu-node"] != "n1" || b.Labels["hami.io/vgpu-node"] != "n1" {
		t.Errorf("Binding = %+v, want pod p (its UID) to n1 carrying the server's annotations and labels", b)
	}
}

func TestReserveHandOverSkipsPreBindAndBindCarriesTheAnnotations(t *testing.T) {
	for _, tc := range []struct {
		name        string
		bind        []string
		serverHands bool
		wantAsk     bool // ReserveRequest.hand_over
		wantPreBind bool // PreBind still runs and calls the server
	}{
		{"nothing to wait for on the node", []string{Name, "DefaultBinder"}, true, true, false},
		{"the pod must wait at PreBind", []string{Name, "DefaultBinder"}, false, true, true},
		{"DefaultBinder binds first", []string{"DefaultBinder", Name}, true, false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fake_, p := startFake(t, nil)
			cs := fake.NewClientset()
			got := bindings(cs, nil)
			p.handle = &fakeHandle{cs: cs, bind: tc.bind}
			fake_.set(func(s *fakeServer) { s.reserveHandsOver = tc.serverHands })
			pod := makePod("p").gpu("1").obj()
			ctx := context.Background()
			state := decided(t, fake_, p)
			if st := p.Reserve(ctx, state, pod, "n1"); !st.IsSuccess() {
				t.Fatalf("Reserve = %v", st)
			}
			_, pre := p.PreBindPreFlight(ctx, state, pod, "n1") // reads Reserve's answer
			if _, r, _, _ := fake_.last(); r.GetHandOver() != tc.wantAsk {
				t.Errorf("ReserveRequest.hand_over = %v, want %v", r.GetHandOver(), tc.wantAsk)
			}
			if skipped := pre.Code() == fwk.Skip; skipped == tc.wantPreBind {
				t.Errorf("PreBindPreFlight = %v, want PreBind to run: %v", pre, tc.wantPreBind)
			}
			if st := p.PreBind(ctx, state, pod, "n1"); !st.IsSuccess() {
				t.Fatalf("PreBind = %v", st)
			}
			if n := fake_.count("PreBind"); (n > 0) != tc.wantPreBind {
				t.Errorf("PreBind RPCs = %d, want any: %v", n, tc.wantPreBind)
			}
			st := p.Bind(ctx, state, pod, "n1")
			if !tc.wantAsk {
				if st.Code() != fwk.Skip || len(*got) != 0 {
					t.Errorf("Bind = %v with %d bindings, want Skip (DefaultBinder's)", st, len(*got))
				}
				return
			}
			if !st.IsSuccess() || len(*got) != 1 || (*got)[0].Annotations["hami.io/vgpu-node"] != "n1" {
				t.Errorf("Bind = %v, bindings %+v, want one Binding carrying the annotations", st, *got)
			}
		})
	}
}

func TestBindLeavesPodsWithoutHandedOverAnnotationsToDefaultBinder(t *testing.T) {
	fake_, p := startFake(t, nil)
	cs := fake.NewClientset()
	got := bindings(cs, nil)
	// Tessera listed after DefaultBinder: the server must write the annotations itself.
	p.handle = &fakeHandle{cs: cs, bind: []string{"DefaultBinder", Name}}
	pod := makePod("p").gpu("1").obj()
	ctx := context.Background()
	state := decided(t, fake_, p)
	if st := p.PreBind(ctx, state, pod, "n1"); !st.IsSuccess() {
		t.Fatalf("PreBind = %v", st)
	}
	if _, _, _, r := fake_.last(); r.GetHandOver() {
		t.Errorf("PreBindRequest.hand_over = true, want false (DefaultBinder binds first)")
	}
	if st := p.Bind(ctx, state, pod, "n1"); st.Code() != fwk.Skip {
		t.Errorf("Bind = %v, want Skip", st)
	}
	// A pod without a Tessera decision (no GPU) is skipped too.
	if st := p.Bind(ctx, newState(), makePod("plain").obj(), "n1"); st.Code() != fwk.Skip {
		t.Errorf("Bind of a plain pod = %v, want Skip", st)
	}
	if len(*got) != 0 {
		t.Errorf("bindings = %d, want 0", len(*got))
	}
}

func TestBindFailureIsAnErrorNamingThePod(t *testing.T) {
	fake_, p := startFake(t, nil)
	cs := fake.NewClientset()
	bindings(cs, errors.New(`pods "p" not found`))
	p.handle = &fakeHandle{cs: cs, bind: []string{Name}}
	pod := makePod("p").gpu("1").obj()
	ctx := context.Background()
	state := decided(t, fake_, p)
	if st := p.PreBind(ctx, state, pod, "n1"); !st.IsSuccess() {
		t.Fatalf("PreBind = %v", st)
	}
	st := p.Bind(ctx, state, pod, "n1")
	if st.Code() != fwk.Error || !strings.Contains(st.Message(), "binding pod default/p to node n1") {
		t.Errorf("Bind = %v %q, want Error naming the pod and node", st.Code(), st.Message())
	}
}

func TestPreBindRefusesAHandOverWithoutAnnotations(t *testing.T) {
	fake_, p := startFake(t, nil)
	p.handle = &fakeHandle{cs: fake.NewClientset(), bind: []string{Name}}
	pod := makePod("p").gpu("1").obj()
	state := decided(t, fake_, p)
	fake_.set(func(s *fakeServer) { s.noAnnotations = true })
	st := p.PreBind(context.Background(), state, pod, "n1")
	if st.Code() != fwk.Error || !strings.Contains(st.Message(), "no annotations handed over") {
		t.Errorf("PreBind = %v %q, want Error (never bind without annotations)", st.Code(), st.Message())
	}
	if _, err := state.Read(bindKey); err == nil {
		t.Errorf("PreBind stored a hand-over without annotations")
	}
}

func TestHandOverAttemptEndsAtBindWithItsSpan(t *testing.T) {
	fake_, p := startFake(t, nil)
	rec := traced(t, p, attemptGrace)
	cs := fake.NewClientset()
	bindings(cs, nil)
	p.handle = &fakeHandle{cs: cs, bind: []string{Name}}
	fake_.set(func(s *fakeServer) { s.preFilter = okResponse() })
	pod := makePod("p").gpu("1").obj()
	state := newState()
	ctx := context.Background()
	p.PreFilter(ctx, state, pod, nil)
	p.Reserve(ctx, state, pod, "n1")
	if st := p.PreBind(ctx, state, pod, "n1"); !st.IsSuccess() {
		t.Fatalf("PreBind = %v", st)
	}
	for _, s := range rec.Ended() {
		if s.Name() == SpanAttempt {
			t.Fatalf("root ended at PreBind (outcome %q); Bind is still to come", attr(s, AttrOutcome))
		}
	}
	if st := p.Bind(ctx, state, pod, "n1"); !st.IsSuccess() {
		t.Fatalf("Bind = %v", st)
	}
	tree := ended(t, rec)
	root, bind := tree.get(t, SpanAttempt), tree.get(t, SpanBind)
	if got := attr(root, AttrOutcome); got != OutcomeBound {
		t.Errorf("root outcome %q, want %q", got, OutcomeBound)
	}
	if bind.Parent().SpanID() != root.SpanContext().SpanID() || attr(bind, AttrNode) != "n1" || attr(bind, AttrOutcome) != OutcomeOK {
		t.Errorf("Bind span: parent %v, node %q, outcome %q", bind.Parent(), attr(bind, AttrNode), attr(bind, AttrOutcome))
	}
}
