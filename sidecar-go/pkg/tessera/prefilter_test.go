package tessera

import (
	"context"
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/client-go/kubernetes/fake"
	fwk "k8s.io/kube-scheduler/framework"

	"tessera/sidecar-go/pkg/pluginv1"
)

func TestPodsWithoutTesseraResourcesAreAskedAboutOnlyIfTheyMayBeTheServers(t *testing.T) {
	for _, tc := range []struct {
		name     string
		args     *Args
		pod      *v1.Pod
		wantCall bool
	}{
		{"plain pod", nil, makePod("cpu").obj(), false},
		{"names fragmentation", nil, makePod("cpu").annotate(nodePolicyAnnotation, "fragmentation").obj(), true},
		{"names binpack", nil, makePod("cpu").annotate(nodePolicyAnnotation, "binpack").obj(), false},
		{"routed here (hostOnlyPods)", &Args{HostOnlyPods: true}, makePod("cpu").obj(), true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fake, p := startFake(t, tc.args)
			fake.set(func(s *fakeServer) {
				s.preFilter = &pluginv1.PreFilterResponse{Code: pluginv1.PreFilterResponse_SKIP}
			})
			if _, st := p.PreFilter(context.Background(), newState(), tc.pod, nil); st.Code() != fwk.Skip {
				t.Errorf("PreFilter = %v, want Skip", st)
			}
			if called := fake.count("PreFilter") > 0; called != tc.wantCall {
				t.Errorf("server asked: %v, want %v", called, tc.wantCall)
			}
		})
	}
}

func TestPodsWithoutTesseraResourcesTheServerSkipsAreKubeSchedulers(t *testing.T) {
	fake, p := startFake(t, &Args{HostOnlyPods: true})
	fake.set(func(s *fakeServer) {
		s.preFilter = &pluginv1.PreFilterResponse{Code: pluginv1.PreFilterResponse_SKIP}
	})
	for name, pod := range map[string]*v1.Pod{
		"cpu only":       makePod("cpu").obj(),
		"zero gpu limit": makePod("zero").gpu("0").obj(),
	} {
		t.Run(name, func(t *testing.T) {
			state := newState()
			res, st := p.PreFilter(context.Background(), state, pod, nil)
			if st.Code() != fwk.Skip || res != nil {
				t.Fatalf("PreFilter = %v, %v; want nil, Skip", res, st)
			}
			if st := p.PreScore(context.Background(), state, pod, nil); st.Code() != fwk.Skip {
				t.Errorf("PreScore = %v, want Skip", st)
			}
			if st := p.Reserve(context.Background(), state, pod, "n1"); !st.IsSuccess() {
				t.Errorf("Reserve = %v, want Success", st)
			}
			p.Unreserve(context.Background(), state, pod, "n1")
			if _, st := p.PreBindPreFlight(context.Background(), state, pod, "n1"); st.Code() != fwk.Skip {
				t.Errorf("PreBindPreFlight = %v, want Skip", st)
			}
			if st := p.PreBind(context.Background(), state, pod, "n1"); !st.IsSuccess() {
				t.Errorf("PreBind = %v, want Success", st)
			}
		})
	}
	if pf, n := fake.count("PreFilter"), fake.total(); pf != 2 || n != 2 {
		t.Errorf("server got %d calls (%d PreFilter) for pods it skips, want the 2 PreFilters alone", n, pf)
	}
}

// A pod without a GPU the server places (fragmentation policy): Filter and Score read the
// decision, Reserve counts it without asking for a hand-over, and nothing else is Tessera's:
// no PreBind call, DefaultBinder binds.
func TestAPodWithoutAGPUThatTheServerPlacesIsReservedAndLeftToDefaultBinder(t *testing.T) {
	fake_, p := startFake(t, nil)
	cs := fake.NewClientset()
	got := bindings(cs, nil)
	p.handle = &fakeHandle{cs: cs, bind: []string{Name, "DefaultBinder"}}
	fake_.set(func(s *fakeServer) {
		s.preFilter = &pluginv1.PreFilterResponse{
			Code: pluginv1.PreFilterResponse_OK, FeasibleNodes: []string{"cpu-1"}, Scores: []int64{100},
			DecisionId: 7, // every node that fits offered: the pod named nodes of its own
		}
		s.reserveHandsOver = true
	})
	pod := makePod("cpu").annotate(nodePolicyAnnotation, "fragmentation").obj()
	ctx, state := context.Background(), newState()
	res, st := p.PreFilter(ctx, state, pod, nil)
	if !st.IsSuccess() || res == nil || !res.NodeNames.Equal(sets.New("cpu-1")) {
		t.Fatalf("PreFilter = %v, %v; want the offered node", res, st)
	}
	if st := p.Filter(ctx, state, pod, nodeInfo("cpu-1")); !st.IsSuccess() {
		t.Errorf("Filter(cpu-1) = %v", st)
	}
	if s, _ := p.Score(ctx, state, pod, nodeInfo("cpu-1")); s != 100 {
		t.Errorf("Score(cpu-1) = %d, want 100", s)
	}
	if st := p.Reserve(ctx, state, pod, "cpu-1"); !st.IsSuccess() {
		t.Fatalf("Reserve = %v", st)
	}
	if _, pre := p.PreBindPreFlight(ctx, state, pod, "cpu-1"); pre.Code() != fwk.Skip {
		t.Errorf("PreBindPreFlight = %v, want Skip", pre)
	}
	if _, r, _, _ := fake_.last(); r.GetDecisionId() != 7 || r.GetHandOver() {
		t.Errorf("Reserve sent %v; want decision 7 without hand-over", r)
	}
	if st := p.PreBind(ctx, state, pod, "cpu-1"); !st.IsSuccess() {
		t.Errorf("PreBind = %v", st)
	}
	if st := p.Bind(ctx, state, pod, "cpu-1"); st.Code() != fwk.Skip || len(*got) != 0 {
		t.Errorf("Bind = %v with %d bindings, want Skip (DefaultBinder's)", st, len(*got))
	}
	if n := fake_.count("PreBind"); n != 0 {
		t.Errorf("PreBind RPCs = %d, want 0", n)
	}
	// Other plugins rejected the offered node: the next attempt is kube-scheduler's alone.
	retry := newState()
	p.PreFilter(ctx, retry, pod, nil)
	if _, st := p.PostFilter(ctx, retry, pod, nil); st.IsSuccess() {
		t.Fatalf("PostFilter = %v, want a retry", st)
	}
	before := fake_.count("PreFilter")
	if _, st := p.PreFilter(ctx, newState(), pod, nil); st.Code() != fwk.Skip {
		t.Errorf("PreFilter after the best nodes were rejected = %v, want Skip", st)
	}
	if n := fake_.count("PreFilter"); n != before {
		t.Errorf("that PreFilter called the server (%d calls, want %d)", n, before)
	}
}

func TestAPodWithoutAGPUGoesOnWithoutAnUnreachableServer(t *testing.T) {
	fake, p := startFake(t, nil)
	fake.set(func(s *fakeServer) { s.err = status.Error(codes.Unavailable, "down") })
	gpuPod := makePod("gpu").gpu("1").obj()
	cpuPod := makePod("cpu").annotate(nodePolicyAnnotation, "fragmentation").obj()
	if _, st := p.PreFilter(context.Background(), newState(), cpuPod, nil); st.Code() != fwk.Skip {
		t.Errorf("PreFilter of a pod without a GPU = %v, want Skip", st)
	}
	if _, st := p.PreFilter(context.Background(), newState(), gpuPod, nil); st.IsSuccess() || st.Code() == fwk.Skip {
		t.Errorf("PreFilter of a GPU pod = %v, want a failure", st)
	}
}

// A failed Reserve of a pod without a GPU (the server's view behind kube-scheduler's) does not
// stop its binding: kube-scheduler checked its CPU and memory.
func TestAPodWithoutAGPUIsBoundWhateverItsReserveAnswered(t *testing.T) {
	fake, p := startFake(t, nil)
	fake.set(func(s *fakeServer) { s.preFilter = okResponse() })
	pod := makePod("cpu").annotate(nodePolicyAnnotation, "fragmentation").obj()
	ctx, state := context.Background(), newState()
	if _, st := p.PreFilter(ctx, state, pod, nil); !st.IsSuccess() {
		t.Fatalf("PreFilter = %v", st)
	}
	fake.set(func(s *fakeServer) { s.err = status.Error(codes.Aborted, "node n1 no longer fits") })
	if st := p.Reserve(ctx, state, pod, "n1"); !st.IsSuccess() {
		t.Fatalf("Reserve = %v, want Success", st)
	}
	if _, st := p.PreBindPreFlight(ctx, state, pod, "n1"); st.Code() != fwk.Skip {
		t.Errorf("PreBindPreFlight = %v, want Skip", st)
	}
	if st := p.PreBind(ctx, state, pod, "n1"); !st.IsSuccess() {
		t.Errorf("PreBind = %v, want Success", st)
	}
	if st := p.Bind(ctx, state, pod, "n1"); st.Code() != fwk.Skip {
		t.Errorf("Bind = %v, want Skip (DefaultBinder's)", st)
	}
	if n := fake.count("Reserve"); n != 1 {
		t.Errorf("Reserve RPCs = %d, want 1", n)
	}
}

func TestPreFilterDecisionServesFilterAndScoreWithoutFurtherRPC(t *testing.T) {
	fake, p := startFake(t, nil)
	fake.set(func(s *fakeServer) { s.preFilter = okResponse() })
	pod := makePod("gpu").gpu("1").mem("3000").annotate("nvidia.com/vgpu-mode", "mig").obj()
	pod.ManagedFields = []metav1.ManagedFieldsEntry{{Manager: "kubectl"}}
	state := newState()
	ctx := context.Background()

	res, st := p.PreFilter(ctx, state, pod, nil)
	if !st.IsSuccess() {
		t.Fatalf("PreFilter status = %v", st)
	}
	if res != nil {
		t.Errorf("PreFilterResult = %v, want nil (Filter explains rejected nodes)", res)
	}
	for _, n := range []string{"n1", "n2"} {
		if st := p.Filter(ctx, state, pod, nodeInfo(n)); !st.IsSuccess() {
			t.Errorf("Filter(%s) = %v, want Success", n, st)
		}
	}
	// Not preemptible either: Unresolvable, so preemption's dry run skips it.
	st = p.Filter(ctx, state, pod, nodeInfo("n3"))
	if st.Code() != fwk.UnschedulableAndUnresolvable || !strings.Contains(st.Message(), "insufficient GPU memory") {
		t.Errorf("Filter(n3) = %v, want UnschedulableAndUnresolvable with the server's infeasible message", st)
	}
	if st := p.PreScore(ctx, state, pod, nil); !st.IsSuccess() {
		t.Errorf("PreScore = %v, want Success", st)
	}
	for n, want := range map[string]int64{"n1": 30, "n2": 80} {
		if got, st := p.Score(ctx, state, pod, nodeInfo(n)); got != want || !st.IsSuccess() {
			t.Errorf("Score(%s) = %d, %v; want %d", n, got, st, want)
		}
	}
	// A cloned state (preemption, batching) still carries the decision.
	if st := p.Filter(ctx, state.Clone(), pod, nodeInfo("n1")); !st.IsSuccess() {
		t.Errorf("Filter on cloned state = %v", st)
	}
	if n, total := fake.count("PreFilter"), fake.total(); n != 1 || total != 1 {
		t.Errorf("calls: %d PreFilter of %d total, want exactly one PreFilter", n, total)
	}

	req, _, _, _ := fake.last()
	if req.GetVersion() != pluginv1.ProtocolVersion_PROTOCOL_VERSION_1 {
		t.Errorf("version = %v", req.GetVersion())
	}
	if r := req.GetPod(); r.GetNamespace() != "default" || r.GetName() != "gpu" || r.GetUid() != "uid-gpu" {
		t.Errorf("pod ref = %v", r)
	}
	var sent v1.Pod
	if err := json.Unmarshal(req.GetPodJson(), &sent); err != nil {
		t.Fatalf("pod_json: %v", err)
	}
	if sent.Annotations["nvidia.com/vgpu-mode"] != "mig" || sent.Spec.Containers[0].Resources.Limits.Name(DefaultResourceMemoryName, "").Value() != 3000 {
		t.Errorf("pod_json lost annotations or limits: %s", req.GetPodJson())
	}
	if sent.ManagedFields != nil || pod.ManagedFields == nil {
		t.Errorf("managedFields: sent %v, caller's pod now %v; want dropped from the request only", sent.ManagedFields, pod.ManagedFields)
	}
}

func TestPreFilterWithoutExplanationRestrictsNodesToFeasibleOnes(t *testing.T) {
	// Explained lazily: the feasible nodes become the PreFilterResult, so no filter runs on
	// the others (their explanation comes from PostFilter).
	fake, p := startFake(t, nil)
	lazy := okResponse()
	lazy.InfeasibleMessage = ""
	fake.set(func(s *fakeServer) { s.preFilter = lazy })
	pod := makePod("gpu").gpu("1").obj()
	res, st := p.PreFilter(context.Background(), newState(), pod, nil)
	if !st.IsSuccess() || res == nil || !res.NodeNames.Equal(sets.New("n1", "n2")) {
		t.Errorf("PreFilter = %v, %v; want the node set {n1, n2}", res, st)
	}
}

func TestPreFilterMapsServerVerdicts(t *testing.T) {
	cases := []struct {
		name     string
		resp     *pluginv1.PreFilterResponse
		wantCode fwk.Code
		wantMsg  string
	}{
		{"unschedulable", &pluginv1.PreFilterResponse{Code: pluginv1.PreFilterResponse_UNSCHEDULABLE, Message: "0/3 nodes: fragmentation, free [0,1)"},
			fwk.UnschedulableAndUnresolvable, "fragmentation"},
		{"invalid", &pluginv1.PreFilterResponse{Code: pluginv1.PreFilterResponse_INVALID, Message: "gpucores 150 > 100"},
			fwk.UnschedulableAndUnresolvable, "gpucores 150"},
		{"server skip", &pluginv1.PreFilterResponse{Code: pluginv1.PreFilterResponse_SKIP}, fwk.Skip, ""},
		{"ok but no node", &pluginv1.PreFilterResponse{Code: pluginv1.PreFilterResponse_OK, InfeasibleMessage: "no GPU node"},
			fwk.UnschedulableAndUnresolvable, "no GPU node"},
		{"scores do not match nodes", &pluginv1.PreFilterResponse{Code: pluginv1.PreFilterResponse_OK, FeasibleNodes: []string{"n1"}},
			fwk.Error, "1 feasible nodes but 0 scores"},
		{"unknown code", &pluginv1.PreFilterResponse{Code: 99}, fwk.Error, "unknown response code"},
	}
	fake, p := startFake(t, nil)
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			fake.set(func(s *fakeServer) { s.preFilter = tc.resp })
			state := newState()
			_, st := p.PreFilter(context.Background(), state, makePod("p").gpu("1").obj(), nil)
			if st.Code() != tc.wantCode || !strings.Contains(st.Message(), tc.wantMsg) {
				t.Errorf("PreFilter = %v (%q), want %v containing %q", st.Code(), st.Message(), tc.wantCode, tc.wantMsg)
			}
			if _, err := readDecision(state); err == nil {
				t.Errorf("a decision was stored for a rejected pod")
			}
		})
	}
}

// Every transport or server failure must keep a GPU pod Pending (never Success or Skip) with a
// message that names the plugin server, and must leave no decision that Reserve could act on.
func TestPreFilterFailuresKeepGPUPodPending(t *testing.T) {
	cases := []struct {
		name    string
		setup   func(t *testing.T) *Plugin
		wantMsg string
	}{
		{"server down", func(t *testing.T) *Plugin {
			return newTestPlugin(t, &Args{Socket: filepath.Join(t.TempDir(), "absent.sock")})
		}, "tessera plugin server unavailable: PreFilter"},
		{"deadline", func(t *testing.T) *Plugin {
			fake, p := startFake(t, &Args{Timeout: metav1Duration(50 * time.Millisecond)})
			fake.set(func(s *fakeServer) { s.preFilter, s.delay = okResponse(), 5*time.Second })
			return p
		}, "tessera plugin server unavailable: no PreFilter answer within 50ms"},
		{"server error", func(t *testing.T) *Plugin {
			fake, p := startFake(t, nil)
			fake.set(func(s *fakeServer) { s.err = status.Error(codes.Internal, "model not loaded") })
			return p
		}, "tessera plugin server failed PreFilter"},
		{"version refused", func(t *testing.T) *Plugin {
			fake, p := startFake(t, nil)
			fake.set(func(s *fakeServer) { s.err = status.Error(codes.FailedPrecondition, "protocol version 1 unsupported") })
			return p
		}, "protocol version 1 unsupported"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := tc.setup(t)
			state := newState()
			start := time.Now()
			_, st := p.PreFilter(context.Background(), state, makePod("p").gpu("1").obj(), nil)
			if st.IsSuccess() || st.IsSkip() || !strings.Contains(st.Message(), tc.wantMsg) {
				t.Fatalf("PreFilter = %v %q; want a failure containing %q", st.Code(), st.Message(), tc.wantMsg)
			}
			if st.Code() != fwk.Error {
				t.Errorf("code = %v, want Error (backoff retry, no preemption)", st.Code())
			}
			if elapsed := time.Since(start); elapsed > 3*time.Second {
				t.Errorf("PreFilter took %v; the deadline was not applied", elapsed)
			}
			if _, err := readDecision(state); err == nil {
				t.Errorf("a decision was stored after a failed PreFilter")
			}
		})
	}
}

func TestPostFilterAsksWhyOnlyWhenPreFilterExplainedNothing(t *testing.T) {
	ctx := context.Background()
	pod := makePod("gpu").gpu("1").mem("3000").obj()
	lazy := okResponse()
	lazy.InfeasibleMessage = "" // the server left the explanation for later

	cases := []struct {
		name        string
		preFilter   *pluginv1.PreFilterResponse
		explain     string
		serverErr   error
		wantCalls   int
		wantMessage string
	}{
		{"explained at PreFilter", okResponse(), "", nil, 0, ""},
		{"lazy", lazy, "2/3 nodes are available: 1 node [8× A100 (hami-core)]: insufficient GPU memory", nil, 1, "Tessera: 2/3 nodes are available: 1 node [8× A100 (hami-core)]: insufficient GPU memory"},
		{"every node fits the GPUs", lazy, "", nil, 1, ""},
		{"server gone", lazy, "", status.Error(codes.Unavailable, "down"), 1, "tessera plugin server unavailable: Explain"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			fake, p := startFake(t, nil)
			fake.set(func(s *fakeServer) { s.preFilter = tc.preFilter; s.explain = tc.explain })
			state := newState()
			if _, st := p.PreFilter(ctx, state, pod, nil); !st.IsSuccess() {
				t.Fatalf("PreFilter = %v", st)
			}
			if tc.preFilter.GetInfeasibleMessage() == "" {
				st := p.Filter(ctx, state, pod, nodeInfo("n3"))
				if st.Code() != fwk.UnschedulableAndUnresolvable || st.Message() != genericInfeasible {
					t.Errorf("Filter(n3) = %v, want UnschedulableAndUnresolvable %q", st, genericInfeasible)
				}
			}
			fake.set(func(s *fakeServer) { s.err = tc.serverErr })
			res, st := p.PostFilter(ctx, state, pod, nil)
			if res != nil || st.Code() != fwk.Unschedulable {
				t.Errorf("PostFilter = %v, %v; want no nomination, Unschedulable", res, st)
			}
			if !strings.Contains(st.Message(), tc.wantMessage) || (tc.wantMessage == "" && st.Message() != "") {
				t.Errorf("PostFilter message = %q, want %q", st.Message(), tc.wantMessage)
			}
			if got := fake.count("Explain"); got != tc.wantCalls {
				t.Errorf("Explain calls = %d, want %d", got, tc.wantCalls)
			}
			if tc.wantCalls > 0 && tc.serverErr == nil {
				fake.mu.Lock()
				req := fake.lastExpl
				fake.mu.Unlock()
				if req.GetDecisionId() != tc.preFilter.GetDecisionId() || req.GetPod().GetName() != "gpu" {
					t.Errorf("Explain request = %v", req)
				}
			}
		})
	}
	// Without a decision (pod skipped or rejected at PreFilter) there is nothing to add.
	_, p := startFake(t, nil)
	if _, st := p.PostFilter(ctx, newState(), pod, nil); st.Code() != fwk.Unschedulable || st.Message() != "" {
		t.Errorf("PostFilter without decision = %v", st)
	}
}
