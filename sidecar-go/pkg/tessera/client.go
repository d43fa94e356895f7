package tessera

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	fwk "k8s.io/kube-scheduler/framework"
)

// dial returns a lazily connecting client; grpc reconnects by itself. The backoff is capped at a
// second (grpc's default cap is 120 s) because the server is local and a restarted server should
// be answering pods again within a second, not minutes.
func dial(args *Args) (*grpc.ClientConn, error) {
	target := "unix://" + args.Socket
	if args.Address != "" {
		target = "dns:///" + args.Address
	}
	conn, err := grpc.NewClient(target,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 50 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: time.Second},
			MinConnectTimeout: time.Second,
		}),
		grpc.WithUnaryInterceptor(propagateTraceContext),
	)
	if err != nil {
		return nil, fmt.Errorf("%s: plugin server target %q: %w", Name, target, err)
	}
	return conn, nil
}

// traceContext reads and writes W3C trace context (traceparent, tracestate).
var traceContext = propagation.TraceContext{}

// propagateTraceContext puts the caller's trace context into the outgoing metadata so one trace
// spans the shim and the plugin server (outgoingTraceContext). Without one (tracing off) it
// adds nothing and allocates nothing.
func propagateTraceContext(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn,
	invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	if carrier := outgoingTraceContext(ctx); len(carrier) > 0 {
		ctx = appendOutgoing(ctx, carrier)
	}
	return invoker(ctx, method, req, reply, cc, opts...)
}

// traceCarried says whether a call made in ctx has a trace context to pass on: the span in
// ctx (the call's client span), or a traceparent that arrived in incoming gRPC metadata.
func traceCarried(ctx context.Context) bool {
	if trace.SpanContextFromContext(ctx).IsValid() {
		return true
	}
	_, ok := metadata.FromIncomingContext(ctx)
	return ok
}

// injectTraceContext writes ctx's trace context into carrier (traceCarried's sources, in
// that order).
func injectTraceContext(ctx context.Context, carrier propagation.MapCarrier) {
	if trace.SpanContextFromContext(ctx).IsValid() {
		traceContext.Inject(ctx, carrier)
		return
	}
	if in, ok := metadata.FromIncomingContext(ctx); ok {
		for _, key := range traceContext.Fields() {
			if v := in.Get(key); len(v) > 0 {
				carrier[key] = v[0]
			}
		}
	}
}

func appendOutgoing(ctx context.Context, carrier propagation.MapCarrier) context.Context {
	if len(carrier) == 0 {
		return ctx
	}
	kv := make([]string, 0, 2*len(carrier))
	for k, v := range carrier {
		kv = append(kv, k, v)
	}
	return metadata.AppendToOutgoingContext(ctx, kv...)
}

// rpcFailure turns a failed call into a status that keeps the pod Pending. Transport failures
// (server down, deadline) are Error, not Unschedulable: Error sends the pod to the backoff queue,
// so it is retried within seconds of the server coming back, whereas an Unschedulable pod waits
// for a cluster event (none fires when the server recovers) and would also trigger preemption.
func rpcFailure(call string, timeout time.Duration, err error) *fwk.Status {
	return fwk.AsStatus(describeRPCError(call, timeout, err))
}

func describeRPCError(call string, timeout time.Duration, err error) error {
	st, _ := status.FromError(err)
	switch {
	case errors.Is(err, context.DeadlineExceeded) || st.Code() == codes.DeadlineExceeded:
		return fmt.Errorf("tessera plugin server unavailable: no %s answer within %s: %w", call, timeout, err)
	case st.Code() == codes.Unavailable || st.Code() == codes.Canceled:
		return fmt.Errorf("tessera plugin server unavailable: %s: %w", call, err)
	default:
		return fmt.Errorf("tessera plugin server failed %s: %w", call, err)
	}
}
