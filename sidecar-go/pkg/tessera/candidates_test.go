package tessera

import (
	"context"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	fwk "k8s.io/kube-scheduler/framework"

	"tessera/sidecar-go/pkg/pluginv1"
)

func TestPreFilterAsksForCandidatesOnlyForPodsNothingElseNarrows(t *testing.T) {
	fake_, p := startFake(t, nil)
	fake_.set(func(s *fakeServer) { s.preFilter = okResponse() })
	spread := makePod("spread").gpu("1").obj()
	spread.Spec.TopologySpreadConstraints = []v1.TopologySpreadConstraint{{MaxSkew: 1, TopologyKey: "zone"}}
	affine := makePod("affine").gpu("1").obj()
	affine.Spec.Affinity = &v1.Affinity{}
	selected := makePod("selected").gpu("1").obj()
	selected.Spec.NodeSelector = map[string]string{"gpu": "a100"}
	nominated := makePod("nominated").gpu("1").obj()
	nominated.Status.NominatedNodeName = "n2" // by an earlier preemption
	cases := []struct {
		pod  *v1.Pod
		want uint32
	}{
		{makePod("plain").gpu("1").obj(), uint32(DefaultCandidateNodes)},
		{spread, 0}, {affine, 0}, {selected, 0}, {nominated, 0},
	}
	for _, tc := range cases {
		if _, st := p.PreFilter(context.Background(), newState(), tc.pod, nil); !st.IsSuccess() {
			t.Fatalf("PreFilter(%s) = %v", tc.pod.Name, st)
		}
		if r, _, _, _ := fake_.last(); r.GetCandidateNodes() != tc.want {
			t.Errorf("%s: candidate_nodes = %d, want %d", tc.pod.Name, r.GetCandidateNodes(), tc.want)
		}
	}
	off := int32(0)
	_, p0 := startFake(t, &Args{CandidateNodes: &off})
	if got := p0.candidateNodes(makePod("plain").gpu("1").obj()); got != 0 {
		t.Errorf("candidateNodes with candidateNodes: 0 = %d, want 0 (every feasible node)", got)
	}
}

func TestRejectedCandidatesSendThePodBackForEveryFeasibleNode(t *testing.T) {
	fake_, p := startFake(t, nil)
	h := &fakeHandle{}
	p.handle = h
	truncated := okResponse()
	truncated.FeasibleTotal, truncated.InfeasibleMessage = 900, ""
	fake_.set(func(s *fakeServer) { s.preFilter = truncated })
	pod := makePod("p").gpu("1").obj()
	ctx := context.Background()

	state := newState()
	if _, st := p.PreFilter(ctx, state, pod, nil); !st.IsSuccess() {
		t.Fatalf("PreFilter = %v", st)
	}
	_, st := p.PostFilter(ctx, state, pod, nil)
	// Unresolvable: kube-scheduler runs no later PostFilter plugin (DefaultPreemption) for a pod
	// that is retried at once with every feasible node.
	if st.Code() != fwk.UnschedulableAndUnresolvable || !strings.Contains(st.Message(), "rejected the 2 best of 900 nodes") {
		t.Errorf("PostFilter = %v %q, want UnschedulableAndUnresolvable saying the candidates were rejected", st.Code(), st.Message())
	}
	if len(h.activated) != 1 || h.activated[0] != "default/p" {
		t.Errorf("activated = %v, want the pod sent back to the active queue", h.activated)
	}
	if n := fake_.count("Explain"); n != 0 {
		t.Errorf("Explain calls = %d, want 0 (every candidate fit the GPU request)", n)
	}

	// The next attempt asks for every feasible node; once reserved, candidates again.
	fake_.set(func(s *fakeServer) { s.preFilter = okResponse() })
	state = newState()
	p.PreFilter(ctx, state, pod, nil)
	if r, _, _, _ := fake_.last(); r.GetCandidateNodes() != 0 {
		t.Errorf("retry candidate_nodes = %d, want 0", r.GetCandidateNodes())
	}
	if st := p.Reserve(ctx, state, pod, "n1"); !st.IsSuccess() {
		t.Fatalf("Reserve = %v", st)
	}
	p.PreFilter(ctx, newState(), pod, nil)
	if r, _, _, _ := fake_.last(); r.GetCandidateNodes() != uint32(DefaultCandidateNodes) {
		t.Errorf("after Reserve candidate_nodes = %d, want %d", r.GetCandidateNodes(), DefaultCandidateNodes)
	}
}

func TestUntruncatedFailureStillAsksForTheExplanation(t *testing.T) {
	fake_, p := startFake(t, nil)
	p.handle = &fakeHandle{}
	fake_.set(func(s *fakeServer) {
		s.preFilter = &pluginv1.PreFilterResponse{Code: pluginv1.PreFilterResponse_OK, FeasibleNodes: []string{"n1"}, Scores: []int64{1}, DecisionId: 1}
		s.explain = "2/3 nodes: memory"
	})
	pod := makePod("p").gpu("1").obj()
	state := newState()
	p.PreFilter(context.Background(), state, pod, nil)
	if _, st := p.PostFilter(context.Background(), state, pod, nil); !strings.Contains(st.Message(), "2/3 nodes: memory") {
		t.Errorf("PostFilter = %q, want the server's explanation", st.Message())
	}
	if p.wide.has(pod.UID) {
		t.Error("a pod that saw every feasible node was marked for a wider retry")
	}
}
