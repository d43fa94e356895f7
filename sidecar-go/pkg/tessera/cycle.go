package tessera

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"go.opentelemetry.io/otel/propagation"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"tessera/sidecar-go/pkg/pluginv1"
)

// cycleStream is the shim's end of the Cycle stream: the scheduling cycle's PreFilter and
// Reserve, sent in the order kube-scheduler makes them over one stream the server handles in
// order. send returns at once with the answer to come, so Reserve need not wait inside the
// cycle; sendSoon holds a Reserve back (at most window) so that the next cycle's PreFilter
// carries it in its before, one message each way per pod instead of two, once the server has
// said on this stream that it handles before. The stream opens on the first send and again on
// the first send after it broke; a break fails every unanswered call, sent or held back, with
// its error.
type cycleStream struct {
	client pluginv1.SchedulerClient
	// window: how long sendSoon holds a call back for the next send to carry (0: never).
	window time.Duration

	mu      sync.Mutex // guards the fields below, and orders Send
	stream  pluginv1.Scheduler_CycleClient
	close   context.CancelFunc // ends stream
	next    uint64
	waiting map[uint64]chan<- cycleAnswer
	// batches: stream's server answered handles_before.
	batches bool
	// held: calls sendSoon holds back (ids assigned, answers awaited in waiting), sent by the
	// next send or when timer fires, whichever is first.
	held  []*pluginv1.CycleRequest
	timer *time.Timer
}

// reserveWindow is how long a Reserve waits for the next cycle's PreFilter to carry it: while
// pods queue, that PreFilter follows within a fraction of a millisecond; the binding cycle,
// which reads the answer, waits at most this long for a pod that is the last of its queue.
const reserveWindow = 2 * time.Millisecond

// cycleAnswer is one call's response, or why it has none.
type cycleAnswer struct {
	resp *pluginv1.CycleResponse
	err  error
}

func newCycleStream(client pluginv1.SchedulerClient, window time.Duration) *cycleStream {
	return &cycleStream{client: client, window: window, waiting: map[uint64]chan<- cycleAnswer{}}
}

// pendingCall is a sent call's answer to come.
type pendingCall <-chan cycleAnswer

// send sends req (its id set here), carrying the calls held back before it, with ctx's trace
// context. The error is the stream's: it could not be opened or the send failed.
func (c *cycleStream) send(ctx context.Context, req *pluginv1.CycleRequest) (pendingCall, error) {
	return c.sendCall(ctx, req, false)
}

// sendSoon is send, except that the call may wait (at most window) to go with the next one.
func (c *cycleStream) sendSoon(ctx context.Context, req *pluginv1.CycleRequest) (pendingCall, error) {
	return c.sendCall(ctx, req, true)
}

func (c *cycleStream) sendCall(ctx context.Context, req *pluginv1.CycleRequest, soon bool) (pendingCall, error) {
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
	if soon && c.batches && c.window > 0 {
		c.held = append(c.held, req)
		if c.timer == nil {
			stream := c.stream
			c.timer = time.AfterFunc(c.window, func() { c.flushHeld(stream) })
		}
		return answer, nil
	}
	if err := c.sendLocked(req); err != nil {
		delete(c.waiting, req.Id)
		return nil, err
	}
	return answer, nil
}

// sendLocked sends req with the held calls in its before (their answers come in its
// response's); a failed send drops the stream.
func (c *cycleStream) sendLocked(req *pluginv1.CycleRequest) error {
	req.Before = c.held
	c.dropHeldLocked()
	if err := c.stream.Send(req); err != nil {
		// Send's error is io.EOF when the stream broke; Recv (in receive) has the reason.
		c.dropLocked(c.stream, err)
		return err
	}
	return nil
}

// dropHeldLocked forgets the held calls (sent, or failed through waiting) and their timer.
func (c *cycleStream) dropHeldLocked() {
	c.held = nil
	if c.timer != nil {
		c.timer.Stop()
		c.timer = nil
	}
}

// flush sends the held calls now (Unreserve, or a gang's trial, cannot wait for the window).
func (c *cycleStream) flush() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.flushLocked()
}

// flushHeld is the timer's flush of the calls held on stream (not if it has been replaced).
func (c *cycleStream) flushHeld(stream pluginv1.Scheduler_CycleClient) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.stream == stream {
		c.flushLocked()
	}
}

// flushLocked sends the held calls: the last, with the others in its before.
func (c *cycleStream) flushLocked() {
	n := len(c.held)
	if n == 0 || c.stream == nil {
		return
	}
	last := c.held[n-1]
	c.held = c.held[:n-1]
	_ = c.sendLocked(last) // a failure fails every held call's answer (dropLocked)
}

// receive hands each response, and those of its before calls, to its caller until the
// stream ends.
func (c *cycleStream) receive(stream pluginv1.Scheduler_CycleClient) {
	for {
		resp, err := stream.Recv()
		c.mu.Lock()
		if err != nil {
			c.dropLocked(stream, err)
			c.mu.Unlock()
			return
		}
		if resp.GetHandlesBefore() && c.stream == stream {
			c.batches = true
		}
		for _, r := range resp.GetBefore() {
			c.answerLocked(r)
		}
		c.answerLocked(resp)
		c.mu.Unlock()
	}
}

// answerLocked hands resp to the call it answers (each answer channel holds one: never blocks).
func (c *cycleStream) answerLocked(resp *pluginv1.CycleResponse) {
	if answer, ok := c.waiting[resp.GetId()]; ok {
		delete(c.waiting, resp.GetId())
		answer <- cycleAnswer{resp: resp}
	}
}

// dropLocked forgets stream if it is still the current one and fails every unanswered call,
// the held ones too.
func (c *cycleStream) dropLocked(stream pluginv1.Scheduler_CycleClient, err error) {
	if c.stream != stream {
		return
	}
	if _, ok := status.FromError(err); !ok {
		err = status.Error(codes.Unavailable, fmt.Sprintf("Cycle stream ended: %v", err))
	}
	c.close()
	c.stream, c.close, c.batches = nil, nil, false
	c.dropHeldLocked()
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

// reserve sends req soon (sendSoon); the answer is read later (pendingReserve).
func (c *cycleStream) reserve(ctx context.Context, req *pluginv1.ReserveRequest) (pendingCall, error) {
	return c.sendSoon(ctx, &pluginv1.CycleRequest{Call: &pluginv1.CycleRequest_Reserve{Reserve: req}})
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
