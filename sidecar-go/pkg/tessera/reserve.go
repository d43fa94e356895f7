package tessera

import (
	"context"
	"errors"
	"fmt"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	v1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"

	"tessera/sidecar-go/pkg/pluginv1"
)

// Reserve asks the server to count the pod's devices on the chosen node now, before binding.
// When Tessera binds (hand-over) and no earlier pod the node agent could not tell apart is
// allocating on the node, the answer carries the pod's annotations for Bind and PreBind is
// skipped: one round trip per pod instead of two.
func (p *Plugin) Reserve(ctx context.Context, state fwk.CycleState, pod *v1.Pod, nodeName string) *fwk.Status {
	d, err := readDecision(state)
	if errors.Is(err, errNoDecision) {
		return nil // not a Tessera pod
	}
	if err != nil {
		return fwk.AsStatus(err)
	}
	// An earlier Reserve of this cycle state (a gang's trial, a retried binding) must not
	// leave its annotations for this one's Bind.
	state.Delete(bindKey)
	// In a gang's trial cycle kube-scheduler reverts every member's Reserve when the cycle
	// ends: counted while it lasts, never handed over.
	trial := state.IsPodGroupSchedulingCycle()
	ctx, traced := p.tracing.startPhase(ctx, state, SpanReserve, "Reserve", pod, nodeName)
	callCtx, cancel := context.WithTimeout(ctx, p.args.Timeout.Duration)
	defer cancel()
	resp, err := p.client.Reserve(callCtx, &pluginv1.ReserveRequest{
		Version:    pluginv1.ProtocolVersion_PROTOCOL_VERSION_1,
		Pod:        podRef(pod),
		Node:       nodeName,
		DecisionId: d.id,
		HandOver:   !trial && p.bindsFirst(ctx),
		Trial:      trial,
	})
	if err == nil {
		if a := resp.GetAnnotations(); len(a) > 0 {
			state.Write(bindKey, &handedOver{annotations: a, labels: resp.GetLabels()})
		}
		traced.end(OutcomeOK, nil)
		p.wide.remove(pod.UID)
		return nil
	}
	// A failed Reserve leaves the attempt open: the framework calls Unreserve next.
	if st, _ := status.FromError(err); st.Code() == codes.Aborted {
		// Another pod took the devices since PreFilter: an ordinary scheduling miss.
		traced.end(OutcomeUnschedulable, err)
		return fwk.NewStatus(fwk.Unschedulable, fmt.Sprintf("node %s no longer fits: %s", nodeName, st.Message()))
	}
	traced.end(OutcomeError, err)
	return rpcFailure("Reserve", p.args.Timeout.Duration, err)
}

// Unreserve releases what Reserve counted. The server's Unreserve is idempotent and the framework
// ignores failures here, so errors are only logged; the server also drops reservations that are
// never bound when it rebuilds from the API.
func (p *Plugin) Unreserve(ctx context.Context, state fwk.CycleState, pod *v1.Pod, nodeName string) {
	if _, err := readDecision(state); err != nil {
		return
	}
	state.Delete(bindKey)
	ctx, traced := p.tracing.startPhase(ctx, state, SpanUnreserve, "Unreserve", pod, nodeName)
	callCtx, cancel := context.WithTimeout(ctx, p.args.Timeout.Duration)
	defer cancel()
	_, err := p.client.Unreserve(callCtx, &pluginv1.UnreserveRequest{
		Version: pluginv1.ProtocolVersion_PROTOCOL_VERSION_1,
		Pod:     podRef(pod),
		Node:    nodeName,
		// Outside the gang's trial cycle, a member's Unreserve releases an admitted gang.
		GangReleased: pod.Spec.SchedulingGroup != nil && !state.IsPodGroupSchedulingCycle(),
	})
	traced.end(callOutcome(err), err)
	traced.finish(OutcomeUnreserved)
	if err != nil {
		klog.FromContext(ctx).Error(describeRPCError("Unreserve", p.args.Timeout.Duration, err),
			"Unreserve failed", "plugin", Name, "pod", klog.KObj(pod), "node", nodeName)
	}
}
