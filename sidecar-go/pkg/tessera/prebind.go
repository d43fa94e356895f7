package tessera

import (
	"context"
	"fmt"
	"math/rand/v2"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	v1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"

	"tessera/sidecar-go/pkg/pluginv1"
)

// Pauses between PreBind calls the server answered "not yet" (jittered, doubling).
const (
	preBindRetryFirst = 200 * time.Millisecond
	preBindRetryMax   = 2 * time.Second
)

// PreBindPreFlight reads Reserve's answer (the binding cycle's first step) and skips PreBind
// for pods without a Tessera decision and for pods whose annotations Reserve handed over.
// PreBind only patches the pod's own annotations, so it may run in parallel with other
// plugins' PreBind. A failed Reserve is PreBind's to report (a pre-flight may not reject).
func (p *Plugin) PreBindPreFlight(ctx context.Context, state fwk.CycleState, _ *v1.Pod, nodeName string) (*fwk.PreBindPreFlightResult, *fwk.Status) {
	if _, err := readDecision(state); err != nil {
		return nil, fwk.NewStatus(fwk.Skip)
	}
	if hostOnlyDecision(state) {
		p.settleHostOnly(ctx, state, nodeName)
		return nil, fwk.NewStatus(fwk.Skip)
	}
	if p.settleReserve(ctx, state, nodeName).IsSuccess() && handedOverAtReserve(state) {
		return nil, fwk.NewStatus(fwk.Skip)
	}
	return &fwk.PreBindPreFlightResult{AllowParallel: true}, nil
}

// settleHostOnly reads the Reserve answer of a pod without a Tessera resource and ends its
// attempt: its CPU and memory are kube-scheduler's to check, so a failed Reserve (the server's
// view behind kube-scheduler's) does not stop the binding; the server forgets what it counted
// when the pod shows up bound, or at Unreserve.
func (p *Plugin) settleHostOnly(ctx context.Context, state fwk.CycleState, nodeName string) {
	st := p.settleReserve(ctx, state, nodeName)
	if !st.IsSuccess() {
		klog.FromContext(ctx).V(3).Info("Reserve of a pod without a GPU failed; binding it anyway",
			"plugin", Name, "node", nodeName, "status", st.Message())
	}
	if data, err := state.Read(reserveKey); err == nil {
		if r, ok := data.(*pendingReserve); ok {
			r.traced.finish(OutcomeNoGPU)
		}
	}
}

// handedOverAtReserve says whether Reserve's answer already gave Bind the annotations.
func handedOverAtReserve(state fwk.CycleState) bool {
	_, err := state.Read(bindKey)
	return err == nil
}

// PreBind reports a failed Reserve, else asks the server for the reservation's annotations
// unless Reserve handed them over: Bind then carries them in the
// Binding (hand-over), or, when Tessera is not the first bind plugin, the server writes them
// before DefaultBinder binds. Any failure is an Error so kube-scheduler unreserves and retries
// the pod instead of binding it without them.
func (p *Plugin) PreBind(ctx context.Context, state fwk.CycleState, pod *v1.Pod, nodeName string) *fwk.Status {
	if _, err := readDecision(state); err != nil || hostOnlyDecision(state) {
		return nil
	}
	if st := p.settleReserve(ctx, state, nodeName); !st.IsSuccess() {
		return st
	}
	if handedOverAtReserve(state) {
		return nil
	}
	ctx, traced := p.tracing.startPhase(ctx, state, SpanPreBind, "PreBind", pod, nodeName)
	callCtx, cancel := context.WithTimeout(ctx, p.args.BindTimeout.Duration)
	defer cancel()
	handOver := p.bindsFirst(ctx)
	req := &pluginv1.PreBindRequest{
		Version:  pluginv1.ProtocolVersion_PROTOCOL_VERSION_1,
		Pod:      podRef(pod),
		Node:     nodeName,
		HandOver: handOver,
	}
	resp, err := p.client.PreBind(callCtx, req)
	// ResourceExhausted: the node is still allocating an earlier pod the node agent could not
	// tell apart, and the server wrote nothing and keeps the reservation. Waiting here (a
	// goroutine) instead of failing the cycle saves a requeue, an event, a status write and a
	// whole new cycle per retry, and holds no server thread.
	for delay := preBindRetryFirst; status.Code(err) == codes.ResourceExhausted; delay = min(2*delay, preBindRetryMax) {
		select {
		case <-callCtx.Done():
			traced.end(callOutcome(err), err)
			traced.finish(OutcomeError)
			if st := cancelledByScheduler(ctx); st != nil {
				return st
			}
			return fwk.AsStatus(fmt.Errorf("tessera: node %s still allocating an earlier pod after %s: %w",
				nodeName, p.args.BindTimeout.Duration, err))
		case <-time.After(delay/2 + rand.N(delay/2+1)):
		}
		resp, err = p.client.PreBind(callCtx, req)
	}
	traced.end(callOutcome(err), err)
	if err != nil {
		// Unreserve follows and adds its span to the ended attempt.
		traced.finish(OutcomeError)
		if st := cancelledByScheduler(ctx); st != nil {
			return st
		}
		return rpcFailure("PreBind", p.args.BindTimeout.Duration, err)
	}
	if handOver {
		if len(resp.GetAnnotations()) == 0 {
			traced.finish(OutcomeError)
			return fwk.AsStatus(fmt.Errorf("tessera plugin server failed PreBind: no annotations handed over for pod %s/%s", pod.Namespace, pod.Name))
		}
		state.Write(bindKey, &handedOver{annotations: resp.GetAnnotations(), labels: resp.GetLabels()})
	} else {
		traced.finish(OutcomePreBound) // Bind's span ends the attempt after a hand-over
	}
	klog.FromContext(ctx).V(4).Info("PreBind got annotations", "plugin", Name, "pod", klog.KObj(pod),
		"node", nodeName, "annotations", len(resp.GetAnnotations()), "handOver", handOver)
	return nil
}

// cancelledByScheduler: kube-scheduler cancelled the binding cycle itself (its context, not
// the call's timeout) — it preempts a pod still waiting in PreBind this way. That is no server
// failure: the pod goes back to the queue with a status that says what happened (Unschedulable,
// so its PodScheduled condition explains it instead of reading as a scheduler error).
func cancelledByScheduler(ctx context.Context) *fwk.Status {
	if ctx.Err() == nil {
		return nil
	}
	return fwk.NewStatus(fwk.Unschedulable,
		"Tessera: kube-scheduler cancelled this pod's binding while it waited (preempted by a higher-priority pod); it is scheduled again")
}
