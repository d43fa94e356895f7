package tessera

import (
	"context"
	"testing"

	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc/metadata"
)

func TestTraceContextTravelsInMetadata(t *testing.T) {
	fake, p := startFake(t, nil)
	fake.set(func(s *fakeServer) { s.preFilter = okResponse() })
	pod := makePod("p").gpu("1").obj()

	traceID, _ := trace.TraceIDFromHex("4bf92f3577b34da6a3ce929d0e0e4736")
	spanID, _ := trace.SpanIDFromHex("00f067aa0ba902b7")
	sc := trace.NewSpanContext(trace.SpanContextConfig{TraceID: traceID, SpanID: spanID, TraceFlags: trace.FlagsSampled})
	fromSpan := trace.ContextWithSpanContext(context.Background(), sc)
	p.PreFilter(fromSpan, newState(), pod, nil)

	incoming := "00-11111111111111111111111111111111-2222222222222222-01"
	fromMD := metadata.NewIncomingContext(context.Background(), metadata.Pairs("traceparent", incoming))
	p.PreFilter(fromMD, newState(), pod, nil)

	p.PreFilter(context.Background(), newState(), pod, nil)

	want := []string{"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", incoming}
	fake.mu.Lock()
	defer fake.mu.Unlock()
	if len(fake.traceparts) != len(want) || fake.traceparts[0] != want[0] || fake.traceparts[1] != want[1] {
		t.Errorf("server saw traceparent %q, want %q (and none without a trace)", fake.traceparts, want)
	}
}
