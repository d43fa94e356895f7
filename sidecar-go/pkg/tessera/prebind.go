package tessera

import (
	"context"

	v1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"

	"tessera/sidecar-go/pkg/pluginv1"
)

// PreBindPreFlight skips PreBind for pods without a Tessera decision. PreBind only patches the
// pod's own annotations, so it may run in parallel with other plugins' PreBind.
func (p *Plugin) PreBindPreFlight(_ context.Context, state fwk.CycleState, _ *v1.Pod, _ string) (*fwk.PreBindPreFlightResult, *fwk.Status) {
	if _, err := readDecision(state); err != nil {
		return nil, fwk.NewStatus(fwk.Skip)
	}
	return &fwk.PreBindPreFlightResult{AllowParallel: true}, nil
}

// PreBind asks the server to persist the reservation in the pod's annotations. Any failure is an
// Error so kube-scheduler unreserves and retries the pod instead of binding it without one.
func (p *Plugin) PreBind(ctx context.Context, state fwk.CycleState, pod *v1.Pod, nodeName string) *fwk.Status {
	if _, err := readDecision(state); err != nil {
		return nil
	}
	ctx, traced := p.tracing.startPhase(ctx, state, SpanPreBind, "PreBind", pod, nodeName)
	callCtx, cancel := context.WithTimeout(ctx, p.args.BindTimeout.Duration)
	defer cancel()
	resp, err := p.client.PreBind(callCtx, &pluginv1.PreBindRequest{
		Version: pluginv1.ProtocolVersion_PROTOCOL_VERSION_1,
		Pod:     podRef(pod),
		Node:    nodeName,
	})
	traced.end(callOutcome(err), err)
	if err != nil {
		// Unreserve follows and adds its span to the ended attempt.
		traced.finish(OutcomeError)
		return rpcFailure("PreBind", p.args.BindTimeout.Duration, err)
	}
	traced.finish(OutcomeBound)
	klog.FromContext(ctx).V(4).Info("PreBind wrote annotations", "plugin", Name, "pod", klog.KObj(pod),
		"node", nodeName, "annotations", len(resp.GetAnnotations()))
	return nil
}
