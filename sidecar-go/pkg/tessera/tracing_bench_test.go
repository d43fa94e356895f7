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

// Cycle answers each call at once from a goroutine, as the server answers the stream.
func (c memClient) Cycle(ctx context.Context, _ ...grpc.CallOption) (grpc.BidiStreamingClient[pluginv1.CycleRequest, pluginv1.CycleResponse], error) {
	s := &memStream{ctx: ctx, out: make(chan *pluginv1.CycleResponse, 16)}
	s.answer = func(req *pluginv1.CycleRequest) *pluginv1.CycleResponse {
		resp := &pluginv1.CycleResponse{Id: req.GetId()}
		if req.GetPreFilter() != nil {
			resp.Answer = &pluginv1.CycleResponse_PreFilter{PreFilter: c.preFilter}
		} else {
			resp.Answer = &pluginv1.CycleResponse_Reserve{Reserve: &pluginv1.ReserveResponse{}}
		}
		return resp
	}
	return s, nil
}

// memStream is an in-memory Cycle stream: Send queues the answer, Recv returns it.
type memStream struct {
	grpc.ClientStream
	ctx    context.Context
	out    chan *pluginv1.CycleResponse
	answer func(*pluginv1.CycleRequest) *pluginv1.CycleResponse
}

func (s *memStream) Send(req *pluginv1.CycleRequest) error {
	if err := intercept(s.ctx, "Cycle"); err != nil {
		return err
	}
	s.out <- s.answer(req)
	return nil
}

func (s *memStream) Recv() (*pluginv1.CycleResponse, error) {
	select {
	case resp := <-s.out:
		return resp, nil
	case <-s.ctx.Done():
		return nil, s.ctx.Err()
	}
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
