package tessera

import (
	"context"
	"fmt"

	v1 "k8s.io/api/core/v1"
	fwk "k8s.io/kube-scheduler/framework"
)

// Filter compares the node against the verdict PreFilter stored; it never calls the server.
func (p *Plugin) Filter(_ context.Context, state fwk.CycleState, _ *v1.Pod, nodeInfo fwk.NodeInfo) *fwk.Status {
	d, err := readDecision(state)
	if err != nil {
		// The framework skips Filter when PreFilter returned Skip, so this is misconfiguration.
		return fwk.AsStatus(fmt.Errorf("%s Filter without a PreFilter decision (enable %s at preFilter too): %w", Name, Name, err))
	}
	if _, ok := d.scores[nodeInfo.Node().Name]; ok {
		return nil
	}
	return fwk.NewStatus(fwk.Unschedulable, d.infeasibleMessage)
}
