package tessera

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"go.opentelemetry.io/otel/propagation"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"tessera/sidecar-go/pkg/pluginv1"
)

// cycleStream is the shim's end of the Cycle stream: the scheduling cycle's PreFilter and
// Reserve, sent in the order kube-scheduler makes them over one stream the server handles in
// order. send returns at once with the answer to come, so Reserve need not wait inside the
// cycle. The stream opens on the first send and again on the first send after it broke; a
// break fails every unanswered call with its error.
type cycleStream struct {
	client pluginv1.SchedulerClient

	mu      sync.Mutex // guards the fields below, and orders Send
	stream  pluginv1.Scheduler_CycleClient
	close   context.CancelFunc // ends stream
	next    uint64
	waiting map[uint64]chan<- cycleAnswer
}

// cycleAnswer is one call's response, or why it has none.
type cycleAnswer struct {
	resp *pluginv1.CycleResponse
	err  error
}

func newCycleStream(client pluginv1.SchedulerClient) *cycleStream {
	return &cycleStream{client: client, waiting: map[uint64]chan<- cycleAnswer{}}
}

// pendingCall is a sent call's answer to come.
type pendingCall <-chan cycleAnswer

// send sends req (its id set here) with ctx's trace context. The error is the stream's: it
// could not be opened or the send failed.
func (c *cycleStream) send(ctx context.Context, req *pluginv1.CycleRequest) (pendingCall, error) {
	if carrier := outgoingTraceContext(ctx); len(carrier) > 0 {
		req.TraceContext = carrier
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.stream == nil {
		streamCtx, cancel := context.WithCancel(context.Background())
		stream, err := c.client.Cycle(streamCtx)
		if err != nil {
			cancel()
			return nil, err
		}
		c.stream, c.close = stream, cancel
		go c.receive(stream)
	}
	c.next++
	req.Id = c.next
	answer := make(chan cycleAnswer, 1)
	c.waiting[req.Id] = answer
	if err := c.stream.Send(req); err != nil {
		// Send's error is io.EOF when the stream broke; Recv (in receive) has the reason.
		delete(c.waiting, req.Id)
		c.dropLocked(c.stream, err)
		return nil, err
	}
	return answer, nil
}

// receive hands each response to its caller until the stream ends.
func (c *cycleStream) receive(stream pluginv1.Scheduler_CycleClient) {
	for {
		resp, err := stream.Recv()
		c.mu.Lock()
		if err != nil {
			c.dropLocked(stream, err)
			c.mu.Unlock()
			return
		}
		answer, ok := c.waiting[resp.GetId()]
		delete(c.waiting, resp.GetId())
		c.mu.Unlock()
		if ok {
			answer <- cycleAnswer{resp: resp}
		}
	}
}

// dropLocked forgets stream if it is still the current one and fails every unanswered call.
func (c *cycleStream) dropLocked(stream pluginv1.Scheduler_CycleClient, err error) {
	if c.stream != stream {
		return
	}
	if _, ok := status.FromError(err); !ok {
		err = status.Error(codes.Unavailable, fmt.Sprintf("Cycle stream ended: %v", err))
	}
	c.close()
	c.stream, c.close = nil, nil
	for id, answer := range c.waiting {
		answer <- cycleAnswer{err: err}
		delete(c.waiting, id)
	}
}

// Close ends the stream; unanswered calls fail.
func (c *cycleStream) Close() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.stream != nil {
		c.dropLocked(c.stream, status.Error(codes.Canceled, "plugin closed"))
	}
}

// wait is the call's response, or its failure as the status error a unary call would return.
func (pc pendingCall) wait(ctx context.Context) (*pluginv1.CycleResponse, error) {
	select {
	case a := <-pc:
		if a.err != nil {
			return nil, a.err
		}
		if code := codes.Code(a.resp.GetCode()); code != codes.OK {
			return nil, status.Error(code, a.resp.GetMessage())
		}
		return a.resp, nil
	case <-ctx.Done():
		return nil, status.FromContextError(ctx.Err()).Err()
	}
}

// errNoAnswer: the server answered OK without the call's answer (a protocol error).
var errNoAnswer = errors.New("answered OK without an answer")

// preFilter sends req and waits for its answer.
func (c *cycleStream) preFilter(ctx context.Context, req *pluginv1.PreFilterRequest) (*pluginv1.PreFilterResponse, error) {
	pending, err := c.send(ctx, &pluginv1.CycleRequest{Call: &pluginv1.CycleRequest_PreFilter{PreFilter: req}})
	if err != nil {
		return nil, err
	}
	resp, err := pending.wait(ctx)
	if err != nil {
		return nil, err
	}
	if answer := resp.GetPreFilter(); answer != nil {
		return answer, nil
	}
	return nil, fmt.Errorf("PreFilter %w", errNoAnswer)
}

// reserve sends req; the answer is read later (pendingReserve).
func (c *cycleStream) reserve(ctx context.Context, req *pluginv1.ReserveRequest) (pendingCall, error) {
	return c.send(ctx, &pluginv1.CycleRequest{Call: &pluginv1.CycleRequest_Reserve{Reserve: req}})
}

// reserveAnswer is a Reserve call's answer from its response.
func reserveAnswer(resp *pluginv1.CycleResponse, err error) (*pluginv1.ReserveResponse, error) {
	if err != nil {
		return nil, err
	}
	if answer := resp.GetReserve(); answer != nil {
		return answer, nil
	}
	return nil, fmt.Errorf("Reserve %w", errNoAnswer)
}

// outgoingTraceContext is the trace context a call made in ctx carries (nil when tracing is
// off): the span in ctx if there is one, else a traceparent that arrived in incoming gRPC
// metadata.
func outgoingTraceContext(ctx context.Context) propagation.MapCarrier {
	if !traceCarried(ctx) {
		return nil
	}
	carrier := propagation.MapCarrier{}
	injectTraceContext(ctx, carrier)
	return carrier
}
