package tessera

import (
	"context"

	v1 "k8s.io/api/core/v1"
	fwk "k8s.io/kube-scheduler/framework"
)

// PreScore skips Score for pods PreFilter made no decision for (no Tessera resource).
func (p *Plugin) PreScore(_ context.Context, state fwk.CycleState, _ *v1.Pod, _ []fwk.NodeInfo) *fwk.Status {
	if _, err := readDecision(state); err != nil {
		return fwk.NewStatus(fwk.Skip)
	}
	return nil
}

// Score returns the server's score for the node from CycleState; it never calls the server.
func (p *Plugin) Score(_ context.Context, state fwk.CycleState, _ *v1.Pod, nodeInfo fwk.NodeInfo) (int64, *fwk.Status) {
	d, err := readDecision(state)
	if err != nil {
		return 0, nil
	}
	return d.scores[nodeInfo.Node().Name], nil
}

// ScoreExtensions implements fwk.ScorePlugin.
func (p *Plugin) ScoreExtensions() fwk.ScoreExtensions { return p }

// NormalizeScore keeps scores in [0, MaxNodeScore]. The server already normalizes to 0..100 by
// the pod's node policy, so in-range scores pass unchanged (stretching them would overweight
// small differences against the other plugins); out-of-range ones are clamped below and scaled
// down proportionally above.
func (p *Plugin) NormalizeScore(_ context.Context, _ fwk.CycleState, _ *v1.Pod, scores fwk.NodeScoreList) *fwk.Status {
	var highest int64
	for i := range scores {
		if scores[i].Score < 0 {
			scores[i].Score = 0
		}
		highest = max(highest, scores[i].Score)
	}
	if highest <= fwk.MaxNodeScore {
		return nil
	}
	for i := range scores {
		scores[i].Score = scores[i].Score * fwk.MaxNodeScore / highest
	}
	return nil
}
