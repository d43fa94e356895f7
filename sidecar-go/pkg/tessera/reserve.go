package tessera

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	v1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"

	"tessera/sidecar-go/pkg/pluginv1"
)

// Reserve asks the server to count the pod's devices on the chosen node now, before binding.
// It sends the call over the Cycle stream and does not wait for the answer: the server counts
// it before it decides the next pod's PreFilter (which carries it when it follows within
// reserveWindow; the timer sends it alone otherwise), and the binding cycle reads the answer
// (settleReserve). When Tessera binds (hand-over) and no earlier pod the node agent could not
// tell apart is allocating on the node, the answer carries the pod's annotations for Bind and
// PreBind is skipped. In a gang's trial cycle the answer decides whether the gang fits, so
// Reserve waits for it.
func (p *Plugin) Reserve(ctx context.Context, state fwk.CycleState, pod *v1.Pod, nodeName string) *fwk.Status {
	d, err := readDecision(state)
	if errors.Is(err, errNoDecision) {
		return nil // not a Tessera pod
	}
	if err != nil {
		return fwk.AsStatus(err)
	}
	// An earlier Reserve of this cycle state (a gang's trial, a retried binding) must not
	// leave its annotations or its answer for this one's binding.
	state.Delete(bindKey)
	state.Delete(reserveKey)
	// In a gang's trial cycle kube-scheduler reverts every member's Reserve when the cycle
	// ends: counted while it lasts, never handed over.
	trial := state.IsPodGroupSchedulingCycle()
	ctx, traced := p.tracing.startPhase(ctx, state, SpanReserve, "Reserve", pod, nodeName)
	call, err := p.cycle.reserve(ctx, &pluginv1.ReserveRequest{
		Version:    pluginv1.ProtocolVersion_PROTOCOL_VERSION_1,
		Pod:        podRef(pod),
		Node:       nodeName,
		DecisionId: d.id,
		HandOver:   !trial && !d.hostOnly && p.bindsFirst(ctx),
		Trial:      trial,
	})
	if err != nil && d.hostOnly {
		// Nothing counted: kube-scheduler checked the pod's CPU and memory, which is all
		// it asks. The server sees it when the watch shows it bound.
		traced.end(OutcomeError, err)
		traced.finish(OutcomeNoGPU)
		return nil
	}
	if err != nil {
		// A failed Reserve leaves the attempt open: the framework calls Unreserve next.
		traced.end(OutcomeError, err)
		return rpcFailure("Reserve", p.args.Timeout.Duration, err)
	}
	p.wide.remove(pod.UID)
	pending := &pendingReserve{call: call, traced: traced}
	state.Write(reserveKey, pending)
	if trial {
		p.cycle.flush() // the answer is needed now
		return p.settleReserve(ctx, state, nodeName)
	}
	return nil
}

const reserveKey fwk.StateKey = Name + "/reserve"

// pendingReserve is a Reserve sent in the scheduling cycle whose answer the binding cycle
// reads; the first reader waits for it, the others read what it got.
type pendingReserve struct {
	call   pendingCall
	traced call
	once   sync.Once
	status *fwk.Status
}

// Clone implements fwk.StateData: the clones share the one answer.
func (r *pendingReserve) Clone() fwk.StateData { return r }

// settleReserve waits (at most the call timeout) for the answer of the Reserve this cycle
// state sent, if any: its annotations go to Bind (a hand-over), its failure is returned (as a
// failed Reserve would be; Unreserve follows). Every later call returns the same.
func (p *Plugin) settleReserve(ctx context.Context, state fwk.CycleState, nodeName string) *fwk.Status {
	data, err := state.Read(reserveKey)
	if err != nil {
		return nil
	}
	r, ok := data.(*pendingReserve)
	if !ok {
		return fwk.AsStatus(fmt.Errorf("%s: CycleState %q holds %T, want *pendingReserve", Name, reserveKey, data))
	}
	r.once.Do(func() {
		callCtx, cancel := context.WithTimeout(ctx, p.args.Timeout.Duration)
		defer cancel()
		resp, err := reserveAnswer(r.call.wait(callCtx))
		r.status = p.reserveStatus(r.traced, nodeName, resp, err)
		if r.status.IsSuccess() && len(resp.GetAnnotations()) > 0 {
			state.Write(bindKey, &handedOver{annotations: resp.GetAnnotations(), labels: resp.GetLabels()})
		}
	})
	return r.status
}

// reserveStatus is what a Reserve answer means for the pod.
func (p *Plugin) reserveStatus(traced call, nodeName string, resp *pluginv1.ReserveResponse, err error) *fwk.Status {
	if err == nil {
		traced.end(OutcomeOK, nil)
		return nil
	}
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
	// The server must have counted the Reserve before this Unreserve releases it: a call
	// overtaking the stream would release nothing and leave the reservation standing. A
	// Reserve still held back for the next PreFilter goes now.
	p.cycle.flush()
	_ = p.settleReserve(ctx, state, nodeName)
	state.Delete(bindKey)
	state.Delete(reserveKey)
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
