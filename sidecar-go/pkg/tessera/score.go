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

// ScoreExtensions returns nil: the server's scores are already on kube-scheduler's 0..100
// scale (absolute, not stretched per cycle; PreFilter refuses any other), so there is nothing
// to normalize.
func (p *Plugin) ScoreExtensions() fwk.ScoreExtensions { return nil }
