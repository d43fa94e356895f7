package tessera

import (
	"context"
	"encoding/json"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/sets"
	fwk "k8s.io/kube-scheduler/framework"
	"k8s.io/kubernetes/pkg/scheduler/framework"

	"tessera/sidecar-go/pkg/pluginv1"
)

// preemptibleResponse: n1 fits, n2 would fit without lower-priority pods, nothing else fits.
func preemptibleResponse() *pluginv1.PreFilterResponse {
	r := okResponse()
	r.FeasibleNodes, r.Scores = []string{"n1"}, []int64{30}
	r.PreemptibleNodes = []string{"n2"}
	return r
}

// unschedulablePreemptible: no node fits now; n2 would without lower-priority pods.
func unschedulablePreemptible() *pluginv1.PreFilterResponse {
	return &pluginv1.PreFilterResponse{
		Code:              pluginv1.PreFilterResponse_UNSCHEDULABLE,
		InfeasibleMessage: "3 nodes [8× A100 (hami-core)]: no free GPU",
		DecisionId:        7,
		PreemptibleNodes:  []string{"n2"},
	}
}

func podInfo(t *testing.T, pod *v1.Pod) fwk.PodInfo {
	t.Helper()
	pi, err := framework.NewPodInfo(pod)
	if err != nil {
		t.Fatalf("NewPodInfo: %v", err)
	}
	return pi
}

// decide runs PreFilter of pod against resp and returns the cycle's state.
func decide(t *testing.T, fake *fakeServer, p *Plugin, pod *v1.Pod, resp *pluginv1.PreFilterResponse) fwk.CycleState {
	t.Helper()
	fake.set(func(s *fakeServer) { s.preFilter = resp })
	state := newState()
	if _, st := p.PreFilter(context.Background(), state, pod, nil); !st.IsSuccess() {
		t.Fatalf("PreFilter = %v", st)
	}
	return state
}

// recorded is node's what-if in state: the removed UIDs and the added pods' names.
func recorded(state fwk.CycleState, node string) (removed, added []string) {
	w := readWhatIf(state, node)
	if w == nil {
		return nil, nil
	}
	for _, p := range w.added {
		added = append(added, p.Name)
	}
	return w.removed, added
}

func TestFilterTellsPreemptionWhichNodesToTry(t *testing.T) {
	lazy := preemptibleResponse()
	lazy.InfeasibleMessage = ""
	cases := []struct {
		name       string
		resp       *pluginv1.PreFilterResponse
		wantResult sets.Set[string] // nil: every node is filtered
		want       map[string]fwk.Code
		wantMsg    string
	}{
		{"some node fits", preemptibleResponse(), nil,
			map[string]fwk.Code{"n1": fwk.Success, "n2": fwk.Unschedulable, "n3": fwk.UnschedulableAndUnresolvable},
			"insufficient GPU memory"},
		// The PreFilterResult must hold n2: kube-scheduler treats nodes outside it as
		// UnschedulableAndUnresolvable, and preemption would never try it.
		{"explained lazily", lazy, sets.New("n1", "n2"),
			map[string]fwk.Code{"n1": fwk.Success, "n2": fwk.Unschedulable, "n3": fwk.UnschedulableAndUnresolvable},
			genericInfeasible},
		{"no node fits now", unschedulablePreemptible(), nil,
			map[string]fwk.Code{"n1": fwk.UnschedulableAndUnresolvable, "n2": fwk.Unschedulable, "n3": fwk.UnschedulableAndUnresolvable},
			"no free GPU"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			fake, p := startFake(t, nil)
			fake.set(func(s *fakeServer) { s.preFilter = tc.resp })
			pod := makePod("hi").gpu("1").obj()
			state := newState()
			res, st := p.PreFilter(context.Background(), state, pod, nil)
			if !st.IsSuccess() {
				t.Fatalf("PreFilter = %v, want Success", st)
			}
			if tc.wantResult == nil && res != nil || tc.wantResult != nil && (res == nil || !res.NodeNames.Equal(tc.wantResult)) {
				t.Errorf("PreFilterResult = %v, want %v", res, tc.wantResult)
			}
			for node, want := range tc.want {
				st := p.Filter(context.Background(), state, pod, nodeInfo(node))
				if st.Code() != want {
					t.Errorf("Filter(%s) = %v, want %v", node, st, want)
				}
				if !st.IsSuccess() && !strings.Contains(st.Message(), tc.wantMsg) {
					t.Errorf("Filter(%s) message %q, want it to contain %q", node, st.Message(), tc.wantMsg)
				}
			}
			if n := fake.total(); n != 1 {
				t.Errorf("server calls = %d, want only PreFilter's", n)
			}
		})
	}
}

func TestUnschedulablePodWithPreemptibleNodesLeavesPreemptionToRun(t *testing.T) {
	fake, p := startFake(t, nil)
	pod := makePod("hi").gpu("1").obj()
	state := decide(t, fake, p, pod, unschedulablePreemptible())
	d, err := readDecision(state)
	if err != nil || len(d.scores) != 0 || !d.preemptible.Equal(sets.New("n2")) || d.id != 7 {
		t.Fatalf("decision = %+v, %v; want no feasible node, n2 preemptible, id 7", d, err)
	}
	var sent v1.Pod
	if err := json.Unmarshal(d.podJSON, &sent); err != nil || sent.Name != "hi" {
		t.Errorf("decision keeps pod JSON %s (%v), want the pod as PreFilter sent it", d.podJSON, err)
	}
	if p.PreFilterExtensions() == nil {
		t.Fatal("PreFilterExtensions() = nil: preemption could not tell Tessera which pods are gone")
	}
	// The server explained already: PostFilter adds nothing, and is not Unresolvable, so
	// kube-scheduler goes on to DefaultPreemption.
	res, st := p.PostFilter(context.Background(), state, pod, nil)
	if res != nil || st.Code() != fwk.Unschedulable {
		t.Errorf("PostFilter = %v, %v; want nil, Unschedulable", res, st)
	}
	if n := fake.count("Explain"); n != 0 {
		t.Errorf("Explain calls = %d, want 0", n)
	}
}

func TestWhatIfRecordsGPUPodsOnPreemptibleNodesAndClonesStayApart(t *testing.T) {
	fake, p := startFake(t, nil)
	ctx := context.Background()
	pod := makePod("hi").gpu("1").priority(100).obj()
	state := decide(t, fake, p, pod, preemptibleResponse())
	v1Pod, v2Pod := makePod("v1").gpu("1").obj(), makePod("v2").gpu("1").obj()
	cpuPod := makePod("cpu").obj()
	nominated := makePod("nom").gpu("1").priority(200).obj()
	n1, n2, n3 := nodeInfo("n1"), nodeInfo("n2"), nodeInfo("n3")
	must := func(st *fwk.Status) {
		t.Helper()
		if !st.IsSuccess() {
			t.Fatalf("status %v", st)
		}
	}

	must(p.RemovePod(ctx, state, pod, podInfo(t, v1Pod), n2))
	must(p.RemovePod(ctx, state, pod, podInfo(t, cpuPod), n2)) // no Tessera resource: changes nothing on GPUs
	must(p.RemovePod(ctx, state, pod, podInfo(t, v2Pod), n1))  // fits anyway
	must(p.RemovePod(ctx, state, pod, podInfo(t, v2Pod), n3))  // would not fit even so
	if r, a := recorded(state, "n2"); !slices.Equal(r, []string{"uid-v1"}) || a != nil {
		t.Fatalf("n2 what-if = removed %v, added %v; want removed [uid-v1]", r, a)
	}
	for _, n := range []string{"n1", "n3"} {
		if readWhatIf(state, n) != nil {
			t.Errorf("a what-if was recorded on %s, where Filter never asks", n)
		}
	}

	clone := state.Clone()
	must(p.RemovePod(ctx, clone, pod, podInfo(t, v2Pod), n2))
	must(p.AddPod(ctx, state, pod, podInfo(t, nominated), n2))
	if r, a := recorded(clone, "n2"); !slices.Equal(r, []string{"uid-v1", "uid-v2"}) || a != nil {
		t.Errorf("clone's what-if = removed %v, added %v; want removed [uid-v1 uid-v2], nothing added", r, a)
	}
	if r, a := recorded(state, "n2"); !slices.Equal(r, []string{"uid-v1"}) || !slices.Equal(a, []string{"nom"}) {
		t.Errorf("original's what-if = removed %v, added %v; want removed [uid-v1] (not the clone's v2), added [nom]", r, a)
	}

	// A victim added back counts as never removed; a pod removed after being added, as never
	// added. Neither leaks into the other state.
	must(p.AddPod(ctx, clone, pod, podInfo(t, v1Pod), n2))
	must(p.RemovePod(ctx, state, pod, podInfo(t, nominated), n2))
	if r, a := recorded(clone, "n2"); !slices.Equal(r, []string{"uid-v2"}) || a != nil {
		t.Errorf("clone after adding v1 back = removed %v, added %v; want removed [uid-v2]", r, a)
	}
	if r, a := recorded(state, "n2"); !slices.Equal(r, []string{"uid-v1"}) || a != nil {
		t.Errorf("original after removing nom = removed %v, added %v; want removed [uid-v1]", r, a)
	}
	if n := fake.count("FilterWhatIf"); n != 0 {
		t.Errorf("FilterWhatIf calls = %d from AddPod/RemovePod, want 0", n)
	}
}

func TestFilterAsksWhatIfWithExactlyTheRecordedPods(t *testing.T) {
	fake, p := startFake(t, nil)
	ctx := context.Background()
	pod := makePod("hi").gpu("1").mem("3000").priority(100).obj()
	state := decide(t, fake, p, pod, preemptibleResponse())
	nominated := makePod("nom").gpu("1").priority(200).obj()
	nominated.ManagedFields = []metav1.ManagedFieldsEntry{{Manager: "kubectl"}}
	n2 := nodeInfo("n2")
	for _, v := range []*v1.Pod{makePod("v1").gpu("1").obj(), makePod("v2").gpu("1").obj()} {
		p.RemovePod(ctx, state, pod, podInfo(t, v), n2)
	}
	p.AddPod(ctx, state, pod, podInfo(t, nominated), n2)
	fake.set(func(s *fakeServer) {
		s.whatIf = func(req *pluginv1.FilterWhatIfRequest) *pluginv1.FilterWhatIfResponse {
			if len(req.GetRemovedPodUids()) < 2 {
				return &pluginv1.FilterWhatIfResponse{Message: "GPU 0: 2048 MiB free, want 3000"}
			}
			return &pluginv1.FilterWhatIfResponse{Fits: true}
		}
	})

	if st := p.Filter(ctx, state, pod, n2); !st.IsSuccess() {
		t.Fatalf("Filter(n2) = %v, want Success: the server says the pod fits without v1 and v2", st)
	}
	asked := fake.askedWhatIfs()
	if len(asked) != 1 {
		t.Fatalf("FilterWhatIf calls = %d, want 1", len(asked))
	}
	req := asked[0]
	if req.GetVersion() != pluginv1.ProtocolVersion_PROTOCOL_VERSION_1 || req.GetDecisionId() != 42 || req.GetNode() != "n2" ||
		req.GetPod().GetName() != "hi" || req.GetPod().GetUid() != "uid-hi" {
		t.Errorf("request = %v", req)
	}
	if !slices.Equal(req.GetRemovedPodUids(), []string{"uid-v1", "uid-v2"}) {
		t.Errorf("removed_pod_uids = %v, want [uid-v1 uid-v2]", req.GetRemovedPodUids())
	}
	var sent, added v1.Pod
	if err := json.Unmarshal(req.GetPodJson(), &sent); err != nil || sent.Name != "hi" {
		t.Errorf("pod_json = %s (%v), want pod hi", req.GetPodJson(), err)
	}
	if len(req.GetAddedPodsJson()) != 1 {
		t.Fatalf("added_pods_json has %d pods, want 1", len(req.GetAddedPodsJson()))
	}
	if err := json.Unmarshal(req.GetAddedPodsJson()[0], &added); err != nil || added.Name != "nom" || added.ManagedFields != nil ||
		*added.Spec.Priority != 200 {
		t.Errorf("added_pods_json[0] = %s (%v), want pod nom without managedFields", req.GetAddedPodsJson()[0], err)
	}

	// The same what-if again (a victim without GPUs added back) is answered from memory.
	if st := p.Filter(ctx, state, pod, n2); !st.IsSuccess() || fake.count("FilterWhatIf") != 1 {
		t.Errorf("Filter(n2) again = %v after %d FilterWhatIf calls, want Success after 1", st, fake.count("FilterWhatIf"))
	}
	// Nodes that fit, or would not even without the victims, never ask.
	if st := p.Filter(ctx, state, pod, nodeInfo("n1")); !st.IsSuccess() {
		t.Errorf("Filter(n1) = %v", st)
	}
	if st := p.Filter(ctx, state, pod, nodeInfo("n3")); st.Code() != fwk.UnschedulableAndUnresolvable {
		t.Errorf("Filter(n3) = %v", st)
	}

	// v1 added back: the server says no, with its reason.
	clone := state.Clone()
	p.AddPod(ctx, clone, pod, podInfo(t, makePod("v1").gpu("1").obj()), n2)
	st := p.Filter(ctx, clone, pod, n2)
	if st.Code() != fwk.Unschedulable || st.Message() != "GPU 0: 2048 MiB free, want 3000" {
		t.Errorf("Filter(n2) with v1 back = %v, want Unschedulable with the server's message", st)
	}
	if asked := fake.askedWhatIfs(); len(asked) != 2 || !slices.Equal(asked[1].GetRemovedPodUids(), []string{"uid-v2"}) {
		t.Errorf("FilterWhatIf requests = %v, want a second one removing only uid-v2", asked)
	}

	// Only added pods (a nominated pod in an ordinary cycle) cannot make room: no call.
	only := decide(t, fake, p, pod, preemptibleResponse())
	p.AddPod(ctx, only, pod, podInfo(t, nominated), n2)
	if st := p.Filter(ctx, only, pod, n2); st.Code() != fwk.Unschedulable || !strings.Contains(st.Message(), "insufficient GPU memory") {
		t.Errorf("Filter(n2) with only a nominated pod added = %v, want PreFilter's Unschedulable", st)
	}
	if n := fake.count("FilterWhatIf"); n != 2 {
		t.Errorf("FilterWhatIf calls = %d, want still 2", n)
	}
}

// A failed what-if must never let the pod through: the node is no candidate this time.
func TestFilterWhatIfFailureIsUnschedulable(t *testing.T) {
	cases := []struct {
		name    string
		fail    func(s *fakeServer)
		wantMsg string
	}{
		{"server error", func(s *fakeServer) { s.err = status.Error(codes.Internal, "model not loaded") },
			"tessera plugin server failed FilterWhatIf"},
		{"server gone", func(s *fakeServer) { s.err = status.Error(codes.Unavailable, "connection refused") },
			"tessera plugin server unavailable: FilterWhatIf"},
		{"deadline", func(s *fakeServer) { s.delay = 5 * time.Second },
			"tessera plugin server unavailable: no FilterWhatIf answer within 50ms"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			fake, p := startFake(t, &Args{Timeout: metav1Duration(50 * time.Millisecond)})
			ctx := context.Background()
			pod := makePod("hi").gpu("1").obj()
			state := decide(t, fake, p, pod, unschedulablePreemptible())
			p.RemovePod(ctx, state, pod, podInfo(t, makePod("v1").gpu("1").obj()), nodeInfo("n2"))
			fake.set(func(s *fakeServer) {
				s.whatIf = func(*pluginv1.FilterWhatIfRequest) *pluginv1.FilterWhatIfResponse {
					return &pluginv1.FilterWhatIfResponse{Fits: true}
				}
				tc.fail(s)
			})
			st := p.Filter(ctx, state, pod, nodeInfo("n2"))
			if st.Code() != fwk.Unschedulable || !strings.Contains(st.Message(), tc.wantMsg) {
				t.Errorf("Filter = %v %q, want Unschedulable containing %q", st.Code(), st.Message(), tc.wantMsg)
			}
			// A failure is not remembered: the next Filter asks again.
			fake.set(func(s *fakeServer) { s.err, s.delay = nil, 0 })
			if st := p.Filter(ctx, state, pod, nodeInfo("n2")); !st.IsSuccess() {
				t.Errorf("Filter after the server recovered = %v, want Success", st)
			}
		})
	}
}

func TestWhatIfSpanJoinsTheAttempt(t *testing.T) {
	fake, p := startFake(t, nil)
	rec := traced(t, p, attemptGrace)
	ctx := context.Background()
	pod := makePod("hi").gpu("1").obj()
	state := decide(t, fake, p, pod, unschedulablePreemptible())
	p.RemovePod(ctx, state, pod, podInfo(t, makePod("v1").gpu("1").obj()), nodeInfo("n2"))
	p.Filter(ctx, state, pod, nodeInfo("n2"))

	tree := ended(t, rec)
	root, span := tree.get(t, SpanAttempt), tree.get(t, SpanFilterWhatIf)
	if span.Parent().SpanID() != root.SpanContext().SpanID() {
		t.Errorf("FilterWhatIf parent %v, want the root %v", span.Parent(), root.SpanContext())
	}
	if attr(span, AttrNode) != "n2" || attr(span, AttrOutcome) != OutcomeUnschedulable || attr(root, AttrNode) != "" {
		t.Errorf("FilterWhatIf node %q outcome %q, root node %q; want n2, %s, none",
			attr(span, AttrNode), attr(span, AttrOutcome), attr(root, AttrNode), OutcomeUnschedulable)
	}
}
