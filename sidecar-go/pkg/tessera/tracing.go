package tessera

// One trace per scheduling attempt of a GPU pod. PreFilter starts the attempt's root span and
// keeps it in CycleState; every RPC runs in a client span under that root, and the client
// interceptor puts the client span's context into the call's gRPC metadata (a Cycle stream
// request carries it in its trace_context), so the plugin server's spans join the same
// trace as children of the call that caused them. Reserve's span ends when the binding
// cycle reads its answer.
//
// The root ends where Tessera's part of the attempt ends: at Bind (when PreBind handed the
// annotations over), at PreBind (otherwise), at Unreserve, or at PreFilter when the answer is
// not OK. When another plugin rejects every node after an OK
// PreFilter, no Tessera hook runs again; the root then ends attemptGrace later, stamped with
// PreFilter's end time and outcome "not-reserved", so the trace is never left without its root.
//
// With tracing off (no provider) the plugin holds a zero tracing value: every helper returns at
// its first check, nothing is written to CycleState and nothing is allocated.

import (
	"context"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	grpcstatus "google.golang.org/grpc/status"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	fwk "k8s.io/kube-scheduler/framework"

	"tessera/sidecar-go/pkg/pluginv1"
)

// TracerName is the instrumentation scope of the shim's spans.
const TracerName = "tessera/sidecar-go/pkg/tessera"

// Span names: the attempt's root, and one client span per RPC.
const (
	SpanAttempt   = "tessera.schedule"
	SpanPreFilter = "tessera.PreFilter"
	SpanReserve   = "tessera.Reserve"
	SpanUnreserve = "tessera.Unreserve"
	SpanPreBind   = "tessera.PreBind"
	// SpanFilterWhatIf is one node's what-if in preemption's dry run; the root may have
	// ended by then (PreFilter found no node that fits now).
	SpanFilterWhatIf = "tessera.FilterWhatIf"
	// SpanBind is the Binding write (an API call, no RPC).
	SpanBind = "tessera.Bind"
)

// Attribute keys; the plugin server uses the same ones.
const (
	AttrNamespace     = attribute.Key("k8s.namespace.name")
	AttrPod           = attribute.Key("k8s.pod.name")
	AttrPodUID        = attribute.Key("k8s.pod.uid")
	AttrNode          = attribute.Key("k8s.node.name")
	AttrOutcome       = attribute.Key("tessera.outcome")
	AttrDecisionID    = attribute.Key("tessera.decision_id")
	AttrFeasibleNodes = attribute.Key("tessera.feasible_nodes")
	attrRPCSystem     = attribute.Key("rpc.system")
	attrRPCService    = attribute.Key("rpc.service")
	attrRPCMethod     = attribute.Key("rpc.method")
	attrGRPCStatus    = attribute.Key("rpc.grpc.status_code")
)

// Outcomes (AttrOutcome): on a phase span, how the phase ended; on the root, how the attempt did.
const (
	OutcomeOK            = "ok"
	OutcomeSkip          = "skip"
	OutcomeUnschedulable = "unschedulable"
	OutcomeInvalid       = "invalid"
	OutcomeError         = "error"
	OutcomeNotReserved   = "not-reserved"
	OutcomeUnreserved    = "unreserved"
	// OutcomePreBound: the server wrote the annotations; DefaultBinder binds.
	OutcomePreBound = "prebound"
	// OutcomeBound: Tessera's Bind wrote the Binding with the annotations.
	OutcomeBound = "bound"
	// OutcomeNoGPU: the pod asked for no GPU; Reserve counted its CPU and memory, and
	// DefaultBinder binds.
	OutcomeNoGPU = "no-gpu"
)

const (
	attemptKey fwk.StateKey = Name + "/attempt"
	// attemptGrace bounds how long an attempt whose PreFilter said OK may go without Reserve.
	// The scheduling cycle from PreFilter to Reserve is synchronous and takes milliseconds.
	attemptGrace = 30 * time.Second
	rpcService   = "tessera.plugin.v1.Scheduler"
)

// tracing is the plugin's tracer; the zero value is off.
type tracing struct {
	tracer trace.Tracer
	// grace is attemptGrace outside tests.
	grace time.Duration
}

func newTracing(tp trace.TracerProvider) tracing {
	if tp == nil {
		return tracing{}
	}
	return tracing{tracer: tp.Tracer(TracerName), grace: attemptGrace}
}

// attempt is the root span of one pod's scheduling attempt, shared by the cycle's CycleState and
// its clones (the binding cycle gets the same state).
type attempt struct {
	span trace.Span
	// timer ends the root if no Reserve follows an OK PreFilter; nil until then.
	timer *time.Timer
}

// Clone implements fwk.StateData: clones share the attempt, which has one root span.
func (a *attempt) Clone() fwk.StateData { return a }

// end ends the root span. The timer calls it too, so it leaves the timer alone.
func (a *attempt) end(outcome string, opts ...trace.SpanEndOption) {
	a.span.SetAttributes(AttrOutcome.String(outcome))
	a.span.End(opts...)
}

// stopTimer runs on the scheduling or binding goroutine, after PreFilter armed the timer there.
func (a *attempt) stopTimer() {
	if a.timer != nil {
		a.timer.Stop()
	}
}

// call is one RPC's client span; the zero value (tracing off) does nothing.
type call struct {
	span    trace.Span
	attempt *attempt
}

func podAttributes(pod *v1.Pod) []attribute.KeyValue {
	return []attribute.KeyValue{
		AttrNamespace.String(pod.Namespace), AttrPod.String(pod.Name), AttrPodUID.String(string(pod.UID)),
	}
}

// startAttempt starts the pod's root span, keeps it in state, and starts PreFilter's call span.
func (t tracing) startAttempt(ctx context.Context, state fwk.CycleState, pod *v1.Pod) (context.Context, call) {
	if t.tracer == nil {
		return ctx, call{}
	}
	rootCtx, root := t.tracer.Start(ctx, SpanAttempt, trace.WithAttributes(podAttributes(pod)...))
	a := &attempt{span: root}
	state.Write(attemptKey, a)
	callCtx, span := t.startCall(rootCtx, SpanPreFilter, "PreFilter", pod, "")
	return callCtx, call{span: span, attempt: a}
}

// startPhase starts the client span of a later RPC under the attempt's root. Reserve stops the
// root's timer: from there on Tessera's PreBind or Unreserve is sure to run.
func (t tracing) startPhase(ctx context.Context, state fwk.CycleState, name, method string, pod *v1.Pod, node string) (context.Context, call) {
	if t.tracer == nil {
		return ctx, call{}
	}
	a := readAttempt(state)
	if a != nil {
		if method == "Reserve" {
			a.stopTimer()
		}
		ctx = trace.ContextWithSpan(ctx, a.span)
		a.span.SetAttributes(AttrNode.String(node))
	}
	callCtx, span := t.startCall(ctx, name, method, pod, node)
	return callCtx, call{span: span, attempt: a}
}

// startWhatIf starts FilterWhatIf's client span under the attempt's root. Unlike startPhase it
// leaves the root's node alone: the dry run asks about many nodes.
func (t tracing) startWhatIf(ctx context.Context, state fwk.CycleState, pod *v1.Pod, node string) (context.Context, call) {
	if t.tracer == nil {
		return ctx, call{}
	}
	if a := readAttempt(state); a != nil {
		ctx = trace.ContextWithSpan(ctx, a.span)
	}
	callCtx, span := t.startCall(ctx, SpanFilterWhatIf, "FilterWhatIf", pod, node)
	return callCtx, call{span: span}
}

// startBind starts the span of Bind's Binding write under the attempt's root.
func (t tracing) startBind(ctx context.Context, state fwk.CycleState, pod *v1.Pod, node string) (context.Context, call) {
	if t.tracer == nil {
		return ctx, call{}
	}
	a := readAttempt(state)
	if a != nil {
		ctx = trace.ContextWithSpan(ctx, a.span)
	}
	callCtx, span := t.tracer.Start(ctx, SpanBind, trace.WithSpanKind(trace.SpanKindClient),
		trace.WithAttributes(append(podAttributes(pod), AttrNode.String(node))...))
	return callCtx, call{span: span, attempt: a}
}

func (t tracing) startCall(ctx context.Context, name, method string, pod *v1.Pod, node string) (context.Context, trace.Span) {
	attrs := append(podAttributes(pod),
		attrRPCSystem.String("grpc"), attrRPCService.String(rpcService), attrRPCMethod.String(method))
	if node != "" {
		attrs = append(attrs, AttrNode.String(node))
	}
	return t.tracer.Start(ctx, name, trace.WithSpanKind(trace.SpanKindClient), trace.WithAttributes(attrs...))
}

func readAttempt(state fwk.CycleState) *attempt {
	data, err := state.Read(attemptKey)
	if err != nil {
		return nil
	}
	a, _ := data.(*attempt)
	return a
}

// end ends the call span with the phase's outcome and the RPC's error, if any.
func (c call) end(outcome string, err error) {
	if c.span == nil {
		return
	}
	if err != nil {
		c.span.RecordError(err)
		c.span.SetStatus(codes.Error, err.Error())
		if st, ok := grpcstatus.FromError(err); ok {
			c.span.SetAttributes(attrGRPCStatus.Int(int(st.Code())))
		}
	}
	c.span.SetAttributes(AttrOutcome.String(outcome))
	c.span.End()
}

// finish ends the attempt (the root span) with its outcome. Unreserve may come without this
// plugin's Reserve (an earlier Reserve plugin failed), so the timer may still be armed.
func (c call) finish(outcome string) {
	if c.attempt == nil {
		return
	}
	c.attempt.stopTimer()
	c.attempt.end(outcome)
}

// endPreFilter ends PreFilter's call span, and the attempt unless the answer was OK; after an
// OK it arms the timer that ends the attempt if no Reserve comes.
func (c call) endPreFilter(st *fwk.Status, resp *pluginv1.PreFilterResponse, err error, grace time.Duration) {
	if c.span == nil {
		return
	}
	outcome := outcomeOf(st)
	switch {
	case err != nil:
		outcome = OutcomeError
	case resp.GetCode() == pluginv1.PreFilterResponse_INVALID:
		outcome = OutcomeInvalid
	case st.Code() == fwk.Error:
		err = st.AsError()
	case resp.GetCode() == pluginv1.PreFilterResponse_UNSCHEDULABLE:
		// Success only so that preemption may try the preemptible nodes: this attempt
		// places the pod nowhere.
		outcome = OutcomeUnschedulable
	}
	if resp != nil {
		c.span.SetAttributes(AttrDecisionID.Int64(int64(resp.GetDecisionId())),
			AttrFeasibleNodes.Int(len(resp.GetFeasibleNodes())))
	}
	c.end(outcome, err)
	if c.attempt == nil {
		return
	}
	if outcome != OutcomeOK {
		c.attempt.end(outcome)
		return
	}
	a, endedAt := c.attempt, time.Now()
	a.timer = time.AfterFunc(grace, func() { a.end(OutcomeNotReserved, trace.WithTimestamp(endedAt)) })
}

// outcomeOf names a framework status for AttrOutcome.
func outcomeOf(st *fwk.Status) string {
	switch st.Code() {
	case fwk.Success:
		return OutcomeOK
	case fwk.Skip:
		return OutcomeSkip
	case fwk.Unschedulable, fwk.UnschedulableAndUnresolvable:
		return OutcomeUnschedulable
	default:
		return OutcomeError
	}
}

// NewWithTracing returns the plugin factory with spans going to tp; a nil tp is New (no tracing).
func NewWithTracing(tp trace.TracerProvider) func(context.Context, runtime.Object, fwk.Handle) (fwk.Plugin, error) {
	return func(ctx context.Context, obj runtime.Object, h fwk.Handle) (fwk.Plugin, error) {
		pl, err := New(ctx, obj, h)
		if err != nil {
			return nil, err
		}
		p := pl.(*Plugin)
		p.tracing = newTracing(tp)
		return p, nil
	}
}

// callOutcome names an RPC's result for calls whose only outcomes are done or failed.
func callOutcome(err error) string {
	if err != nil {
		return OutcomeError
	}
	return OutcomeOK
}
