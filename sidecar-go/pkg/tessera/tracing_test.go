package tessera

import (
	"context"
	"fmt"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	grpccodes "google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	fwk "k8s.io/kube-scheduler/framework"

	"tessera/sidecar-go/pkg/pluginv1"
)

// traced gives p a tracer that records into the returned recorder; grace is attemptGrace.
func traced(t *testing.T, p *Plugin, grace time.Duration) *tracetest.SpanRecorder {
	t.Helper()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	p.tracing = newTracing(tp)
	p.tracing.grace = grace
	return rec
}

// spanTree is what a test checks of the recorded spans.
type spanTree struct {
	byName map[string]sdktrace.ReadOnlySpan
	order  []string
}

func ended(t *testing.T, rec *tracetest.SpanRecorder) spanTree {
	t.Helper()
	tree := spanTree{byName: map[string]sdktrace.ReadOnlySpan{}}
	for _, s := range rec.Ended() {
		if _, dup := tree.byName[s.Name()]; dup {
			t.Fatalf("span %s ended twice", s.Name())
		}
		tree.byName[s.Name()] = s
		tree.order = append(tree.order, s.Name())
	}
	return tree
}

func (tr spanTree) get(t *testing.T, name string) sdktrace.ReadOnlySpan {
	t.Helper()
	s, ok := tr.byName[name]
	if !ok {
		t.Fatalf("no ended span %s; ended: %v", name, tr.order)
	}
	return s
}

func attr(s sdktrace.ReadOnlySpan, key attribute.Key) string {
	for _, kv := range s.Attributes() {
		if kv.Key == key {
			return kv.Value.Emit()
		}
	}
	return ""
}

// traceparent is the W3C header value of a span's context.
func traceparent(sc trace.SpanContext) string {
	return fmt.Sprintf("00-%s-%s-%s", sc.TraceID(), sc.SpanID(), sc.TraceFlags())
}

func TestOneTracePerAttemptWithCallSpansInMetadata(t *testing.T) {
	fake, p := startFake(t, nil)
	rec := traced(t, p, attemptGrace)
	fake.set(func(s *fakeServer) { s.preFilter = okResponse() })
	pod := makePod("p").gpu("1").obj()
	state := newState()
	ctx := context.Background()

	if _, st := p.PreFilter(ctx, state, pod, nil); !st.IsSuccess() {
		t.Fatalf("PreFilter = %v", st)
	}
	if st := p.Reserve(ctx, state, pod, "n2"); !st.IsSuccess() {
		t.Fatalf("Reserve = %v", st)
	}
	if st := p.PreBind(ctx, state, pod, "n2"); !st.IsSuccess() {
		t.Fatalf("PreBind = %v", st)
	}

	tree := ended(t, rec)
	root := tree.get(t, SpanAttempt)
	if root.Parent().IsValid() {
		t.Errorf("root has parent %v", root.Parent())
	}
	for k, want := range map[attribute.Key]string{
		AttrNamespace: "default", AttrPod: "p", AttrPodUID: "uid-p", AttrNode: "n2", AttrOutcome: OutcomePreBound,
	} {
		if got := attr(root, k); got != want {
			t.Errorf("root %s = %q, want %q", k, got, want)
		}
	}
	var wantParents []string
	for _, name := range []string{SpanPreFilter, SpanReserve, SpanPreBind} {
		s := tree.get(t, name)
		if s.SpanContext().TraceID() != root.SpanContext().TraceID() || s.Parent().SpanID() != root.SpanContext().SpanID() {
			t.Errorf("%s: parent %v, want the root %v", name, s.Parent(), root.SpanContext())
		}
		if s.SpanKind() != trace.SpanKindClient || attr(s, AttrOutcome) != OutcomeOK || attr(s, AttrPod) != "p" {
			t.Errorf("%s: kind %v, outcome %q, pod %q", name, s.SpanKind(), attr(s, AttrOutcome), attr(s, AttrPod))
		}
		wantParents = append(wantParents, traceparent(s.SpanContext()))
	}
	if got := attr(tree.get(t, SpanPreFilter), AttrDecisionID); got != "42" {
		t.Errorf("PreFilter decision id = %q", got)
	}
	if got := attr(tree.get(t, SpanReserve), AttrNode); got != "n2" {
		t.Errorf("Reserve node = %q", got)
	}
	// The server saw each call's own span as the parent of its work, in call order.
	fake.mu.Lock()
	got := append([]string(nil), fake.traceparts...)
	fake.mu.Unlock()
	if fmt.Sprint(got) != fmt.Sprint(wantParents) {
		t.Errorf("server saw traceparent %v, want %v", got, wantParents)
	}
	if root.EndTime().Before(tree.get(t, SpanPreBind).EndTime()) {
		t.Error("root ended before PreBind")
	}
}

func TestAttemptEndsWithPreFilterUnlessOK(t *testing.T) {
	cases := []struct {
		name    string
		resp    *pluginv1.PreFilterResponse
		err     error
		outcome string
		isError bool
	}{
		{"unschedulable", &pluginv1.PreFilterResponse{Code: pluginv1.PreFilterResponse_UNSCHEDULABLE, Message: "no GPU"}, nil, OutcomeUnschedulable, false},
		{"unschedulable but preemptible", &pluginv1.PreFilterResponse{Code: pluginv1.PreFilterResponse_UNSCHEDULABLE,
			InfeasibleMessage: "no free GPU", PreemptibleNodes: []string{"n2"}}, nil, OutcomeUnschedulable, false},
		{"no feasible node in an OK answer", &pluginv1.PreFilterResponse{Code: pluginv1.PreFilterResponse_OK}, nil, OutcomeUnschedulable, false},
		{"invalid pod", &pluginv1.PreFilterResponse{Code: pluginv1.PreFilterResponse_INVALID, Message: "bad"}, nil, OutcomeInvalid, false},
		{"server skips", &pluginv1.PreFilterResponse{Code: pluginv1.PreFilterResponse_SKIP}, nil, OutcomeSkip, false},
		{"server down", nil, status.Error(grpccodes.Unavailable, "connection refused"), OutcomeError, true},
		{"unknown code", &pluginv1.PreFilterResponse{Code: 99}, nil, OutcomeError, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			fake, p := startFake(t, nil)
			rec := traced(t, p, attemptGrace)
			fake.set(func(s *fakeServer) { s.preFilter, s.err = tc.resp, tc.err })
			state := newState()
			p.PreFilter(context.Background(), state, makePod("p").gpu("1").obj(), nil)

			tree := ended(t, rec)
			root, call := tree.get(t, SpanAttempt), tree.get(t, SpanPreFilter)
			if attr(root, AttrOutcome) != tc.outcome || attr(call, AttrOutcome) != tc.outcome {
				t.Errorf("outcome root %q, PreFilter %q, want %q", attr(root, AttrOutcome), attr(call, AttrOutcome), tc.outcome)
			}
			if got := call.Status().Code == codes.Error; got != tc.isError {
				t.Errorf("PreFilter span status %v, want error: %v", call.Status(), tc.isError)
			}
			if tc.err != nil && attr(call, attrGRPCStatus) != fmt.Sprint(int(grpccodes.Unavailable)) {
				t.Errorf("grpc status attribute = %q", attr(call, attrGRPCStatus))
			}
		})
	}
}

func TestFailedReserveThenUnreserveEndsAttempt(t *testing.T) {
	fake, p := startFake(t, nil)
	rec := traced(t, p, attemptGrace)
	fake.set(func(s *fakeServer) { s.preFilter = okResponse() })
	pod := makePod("p").gpu("1").obj()
	state := newState()
	ctx := context.Background()
	p.PreFilter(ctx, state, pod, nil)
	fake.set(func(s *fakeServer) { s.err = status.Error(grpccodes.Aborted, "GPU-1 full") })
	if st := p.Reserve(ctx, state, pod, "n1"); !st.IsSuccess() {
		t.Fatalf("Reserve = %v, want Success (the answer is read in the binding cycle)", st)
	}
	if st := p.PreBind(ctx, state, pod, "n1"); st.Code() != fwk.Unschedulable {
		t.Fatalf("PreBind after a failed Reserve = %v", st)
	}
	if got := ended(t, rec).order; len(got) != 2 {
		t.Fatalf("after a failed Reserve ended %v, want PreFilter and Reserve only (root open)", got)
	}
	fake.set(func(s *fakeServer) { s.err = nil })
	p.Unreserve(ctx, state, pod, "n1")

	tree := ended(t, rec)
	root := tree.get(t, SpanAttempt)
	if got := attr(root, AttrOutcome); got != OutcomeUnreserved {
		t.Errorf("root outcome %q", got)
	}
	if got := attr(tree.get(t, SpanReserve), AttrOutcome); got != OutcomeUnschedulable {
		t.Errorf("Reserve outcome %q", got)
	}
	if s := tree.get(t, SpanUnreserve); s.Parent().SpanID() != root.SpanContext().SpanID() {
		t.Errorf("Unreserve parent %v", s.Parent())
	}
}

func TestFailedPreBindEndsAttemptAndUnreserveJoinsIt(t *testing.T) {
	fake, p := startFake(t, nil)
	rec := traced(t, p, attemptGrace)
	state := decided(t, fake, p)
	pod := makePod("p").gpu("1").obj()
	ctx := context.Background()
	p.Reserve(ctx, state, pod, "n1")
	p.PreBindPreFlight(ctx, state, pod, "n1") // Reserve's answer
	fake.set(func(s *fakeServer) { s.err = status.Error(grpccodes.Internal, "patch failed") })
	if st := p.PreBind(ctx, state, pod, "n1"); st.IsSuccess() {
		t.Fatal("PreBind succeeded")
	}
	p.Unreserve(ctx, state, pod, "n1")

	tree := ended(t, rec)
	root := tree.get(t, SpanAttempt)
	if got := attr(root, AttrOutcome); got != OutcomeError {
		t.Errorf("root outcome %q, want the first ending (PreBind's) to stick", got)
	}
	prebind := tree.get(t, SpanPreBind)
	if prebind.Status().Code != codes.Error || attr(prebind, AttrOutcome) != OutcomeError {
		t.Errorf("PreBind span status %v outcome %q", prebind.Status(), attr(prebind, AttrOutcome))
	}
	if s := tree.get(t, SpanUnreserve); s.SpanContext().TraceID() != root.SpanContext().TraceID() {
		t.Error("Unreserve after the failed PreBind is in another trace")
	}
}

func TestAttemptWithoutReserveEndsAtPreFilterTime(t *testing.T) {
	fake, p := startFake(t, nil)
	rec := traced(t, p, 20*time.Millisecond)
	fake.set(func(s *fakeServer) { s.preFilter = okResponse() })
	p.PreFilter(context.Background(), newState(), makePod("p").gpu("1").obj(), nil)

	deadline := time.Now().Add(5 * time.Second)
	for len(rec.Ended()) < 2 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	tree := ended(t, rec)
	root, call := tree.get(t, SpanAttempt), tree.get(t, SpanPreFilter)
	if got := attr(root, AttrOutcome); got != OutcomeNotReserved {
		t.Errorf("root outcome %q", got)
	}
	if root.EndTime().Before(call.EndTime()) || root.EndTime().Sub(call.EndTime()) > 10*time.Millisecond {
		t.Errorf("root ended %v, PreFilter %v: want the root stamped with PreFilter's end, not the timer's",
			root.EndTime(), call.EndTime())
	}
}

func TestReserveStopsTheAttemptTimer(t *testing.T) {
	fake, p := startFake(t, nil)
	rec := traced(t, p, 50*time.Millisecond)
	fake.set(func(s *fakeServer) { s.preFilter = okResponse() })
	pod := makePod("p").gpu("1").obj()
	state := newState()
	p.PreFilter(context.Background(), state, pod, nil)
	p.Reserve(context.Background(), state, pod, "n1")
	time.Sleep(100 * time.Millisecond)
	for _, s := range rec.Ended() {
		if s.Name() == SpanAttempt {
			t.Fatalf("root ended by the timer after Reserve (outcome %q)", attr(s, AttrOutcome))
		}
	}
	p.PreBind(context.Background(), state, pod, "n1")
	if got := attr(ended(t, rec).get(t, SpanAttempt), AttrOutcome); got != OutcomePreBound {
		t.Errorf("root outcome %q", got)
	}
}

func TestTracingOffWritesNothing(t *testing.T) {
	fake, p := startFake(t, nil)
	fake.set(func(s *fakeServer) { s.preFilter = okResponse() })
	pod := makePod("p").gpu("1").obj()
	state := newState()
	ctx := context.Background()
	p.PreFilter(ctx, state, pod, nil)
	p.Reserve(ctx, state, pod, "n1")
	p.PreBind(ctx, state, pod, "n1")
	if _, err := state.Read(attemptKey); err == nil {
		t.Error("tracing off but an attempt is in CycleState")
	}
	fake.mu.Lock()
	defer fake.mu.Unlock()
	if len(fake.traceparts) != 0 {
		t.Errorf("tracing off but the server saw traceparent %v", fake.traceparts)
	}
}

func TestAPodTheServerSkipsEndsItsAttemptAtPreFilter(t *testing.T) {
	fake, p := startFake(t, nil)
	fake.set(func(s *fakeServer) {
		s.preFilter = &pluginv1.PreFilterResponse{Code: pluginv1.PreFilterResponse_SKIP}
	})
	rec := traced(t, p, attemptGrace)
	pod := makePod("cpu-only").annotate(nodePolicyAnnotation, "fragmentation").obj()
	p.PreFilter(context.Background(), newState(), pod, nil)
	if started, ended := len(rec.Started()), len(rec.Ended()); started != ended || ended == 0 {
		t.Fatalf("%d spans started, %d ended; want all of them ended", started, ended)
	}
	for _, s := range rec.Ended() {
		if got := attr(s, AttrOutcome); got != OutcomeSkip {
			t.Errorf("span %s outcome %q, want %q", s.Name(), got, OutcomeSkip)
		}
	}
}

func TestNewWithTracingWiresTheProvider(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	defer func() { _ = tp.Shutdown(context.Background()) }()
	args := &Args{Socket: "/nonexistent/plugin.sock"}
	for _, tc := range []struct {
		name string
		tp   trace.TracerProvider
		want bool
	}{{"provider", tp, true}, {"nil provider", nil, false}} {
		pl, err := NewWithTracing(tc.tp)(context.Background(), args, nil)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		p := pl.(*Plugin)
		if got := p.tracing.tracer != nil; got != tc.want || (tc.want && p.tracing.grace != attemptGrace) {
			t.Errorf("%s: tracing on %v (grace %v), want on %v", tc.name, got, p.tracing.grace, tc.want)
		}
		_ = p.Close()
	}
	if _, err := NewWithTracing(tp)(context.Background(), &Args{Socket: "relative.sock"}, nil); err == nil {
		t.Error("bad args accepted")
	}
}

// Tracing modes of the benchmarks: off (what runs unless OTEL_TRACES_EXPORTER is set) and on
// with a provider that has no exporter (every span is made, then dropped).
var benchTracingModes = []string{"off", "on-no-exporter"}

func benchPlugin(b *testing.B, client pluginv1.SchedulerClient, mode string) *Plugin {
	b.Helper()
	args, err := decodeArgs(nil)
	if err != nil {
		b.Fatal(err)
	}
	p := newPlugin(args, client)
	if mode == "on-no-exporter" {
		tp := sdktrace.NewTracerProvider()
		b.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
		p.tracing = newTracing(tp)
	}
	return p
}

// BenchmarkTracingHelpersOff is exactly what tracing adds to a cycle when it is off.
func BenchmarkTracingHelpersOff(b *testing.B) {
	var off tracing
	pod := makePod("p").gpu("1").obj()
	state := newState()
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		_, c := off.startAttempt(ctx, state, pod)
		c.endPreFilter(nil, nil, nil, off.grace)
		for _, name := range []string{SpanReserve, SpanPreBind} {
			_, c = off.startPhase(ctx, state, name, name, pod, "n1")
			c.end(OutcomeOK, nil)
			c.finish(OutcomeBound)
		}
	}
}
