package tessera

import (
	"context"
	"testing"

	"google.golang.org/grpc"

	"tessera/sidecar-go/pkg/pluginv1"
)

// memClient answers every call at once, in memory, after running the same client interceptor
// the real connection runs: the benchmarks below measure the shim's own cost per cycle, which
// a real call (~100 µs over the Unix socket) would drown.
type memClient struct{ preFilter *pluginv1.PreFilterResponse }

func intercept(ctx context.Context, method string) error {
	return propagateTraceContext(ctx, method, nil, nil, nil,
		func(context.Context, string, any, any, *grpc.ClientConn, ...grpc.CallOption) error { return nil })
}

func (c memClient) PreFilter(ctx context.Context, _ *pluginv1.PreFilterRequest, _ ...grpc.CallOption) (*pluginv1.PreFilterResponse, error) {
	return c.preFilter, intercept(ctx, "PreFilter")
}

func (c memClient) Reserve(ctx context.Context, _ *pluginv1.ReserveRequest, _ ...grpc.CallOption) (*pluginv1.ReserveResponse, error) {
	return &pluginv1.ReserveResponse{}, intercept(ctx, "Reserve")
}

func (c memClient) Unreserve(ctx context.Context, _ *pluginv1.UnreserveRequest, _ ...grpc.CallOption) (*pluginv1.UnreserveResponse, error) {
	return &pluginv1.UnreserveResponse{}, intercept(ctx, "Unreserve")
}

func (c memClient) PreBind(ctx context.Context, _ *pluginv1.PreBindRequest, _ ...grpc.CallOption) (*pluginv1.PreBindResponse, error) {
	return &pluginv1.PreBindResponse{}, intercept(ctx, "PreBind")
}

func (c memClient) Explain(ctx context.Context, _ *pluginv1.ExplainRequest, _ ...grpc.CallOption) (*pluginv1.ExplainResponse, error) {
	return &pluginv1.ExplainResponse{}, intercept(ctx, "Explain")
}

func (c memClient) FilterWhatIf(ctx context.Context, _ *pluginv1.FilterWhatIfRequest, _ ...grpc.CallOption) (*pluginv1.FilterWhatIfResponse, error) {
	return &pluginv1.FilterWhatIfResponse{}, intercept(ctx, "FilterWhatIf")
}

// BenchmarkCycle runs PreFilter, Reserve and PreBind of one GPU pod per iteration.
// Compare off with on-no-exporter (spans recorded, then dropped) for the cost of tracing.
func BenchmarkCycle(b *testing.B) {
	for _, mode := range benchTracingModes {
		b.Run(mode, func(b *testing.B) {
			p := benchPlugin(b, memClient{preFilter: okResponse()}, mode)
			pod := makePod("p").gpu("1").obj()
			ctx := context.Background()
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				state := newState()
				if _, st := p.PreFilter(ctx, state, pod, nil); !st.IsSuccess() {
					b.Fatal(st)
				}
				if st := p.Reserve(ctx, state, pod, "n1"); !st.IsSuccess() {
					b.Fatal(st)
				}
				if st := p.PreBind(ctx, state, pod, "n1"); !st.IsSuccess() {
					b.Fatal(st)
				}
			}
		})
	}
}
