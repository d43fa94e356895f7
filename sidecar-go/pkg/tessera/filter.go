package tessera

import (
	"context"
	"fmt"

	"tessera/sidecar-go/pkg/pluginv1"

	v1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
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
	msg := d.infeasibleMessage
	if msg == "" {
		// The server explains lazily: PostFilter asks for the details if the cycle fails.
		msg = genericInfeasible
	}
	return fwk.NewStatus(fwk.Unschedulable, msg)
}

// genericInfeasible is a rejected node's Filter message when PreFilter found other nodes that
// fit (the server then leaves the explanation to PostFilter).
const genericInfeasible = "Tessera: the pod's GPU request does not fit"

// PostFilter runs only when no node passed every Filter. If Tessera found nodes that fit (and
// so explained nothing yet), it asks the server why the others do not; the answer joins the
// pod's PodScheduled message after kube-scheduler's per-plugin counts. It never nominates a
// node: preemption is DefaultPreemption's.
func (p *Plugin) PostFilter(ctx context.Context, state fwk.CycleState, pod *v1.Pod, _ fwk.NodeToStatusReader) (*fwk.PostFilterResult, *fwk.Status) {
	d, err := readDecision(state)
	if err != nil {
		return nil, fwk.NewStatus(fwk.Unschedulable)
	}
	if d.feasibleTotal > 0 {
		// Other plugins rejected every candidate: try again at once with every feasible node.
		p.wide.add(pod.UID)
		if p.handle != nil {
			p.handle.Activate(klog.FromContext(ctx), map[string]*v1.Pod{pod.Namespace + "/" + pod.Name: pod})
		}
		return nil, fwk.NewStatus(fwk.Unschedulable, fmt.Sprintf(
			"Tessera: other plugins rejected the %d best of %d nodes that fit the GPU request; trying all of them next",
			len(d.scores), d.feasibleTotal))
	}
	if d.infeasibleMessage != "" {
		return nil, fwk.NewStatus(fwk.Unschedulable)
	}
	callCtx, cancel := context.WithTimeout(ctx, p.args.Timeout.Duration)
	defer cancel()
	resp, err := p.client.Explain(callCtx, &pluginv1.ExplainRequest{
		Version:    pluginv1.ProtocolVersion_PROTOCOL_VERSION_1,
		Pod:        podRef(pod),
		DecisionId: d.id,
	})
	if err != nil {
		// Only the explanation is lost; the pod stays Pending either way.
		return nil, fwk.NewStatus(fwk.Unschedulable, describeRPCError("Explain", p.args.Timeout.Duration, err).Error())
	}
	if resp.GetMessage() == "" { // every node fits the GPU request: others rejected them
		return nil, fwk.NewStatus(fwk.Unschedulable)
	}
	return nil, fwk.NewStatus(fwk.Unschedulable, "Tessera: "+resp.GetMessage())
}
