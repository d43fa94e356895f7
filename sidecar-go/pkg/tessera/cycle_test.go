package tessera

import (
	"context"
	"net"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	v1 "k8s.io/api/core/v1"
	fwk "k8s.io/kube-scheduler/framework"

	"tessera/sidecar-go/pkg/pluginv1"
)

// serveFake serves fake on socket until the returned stop is called.
func serveFake(t *testing.T, fake *fakeServer, socket string) (stop func()) {
	t.Helper()
	lis, err := net.Listen("unix", socket)
	if err != nil {
		t.Fatalf("listen: %v", err)
	}
	srv := grpc.NewServer()
	pluginv1.RegisterSchedulerServer(srv, fake)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	return srv.Stop
}

func TestCycleStreamBreakFailsUnansweredCallsAndReopens(t *testing.T) {
	socket := filepath.Join(t.TempDir(), "plugin.sock")
	gate := make(chan struct{})
	first := &fakeServer{calls: map[string]int{}, preFilter: okResponse(), reserveGate: gate}
	stop := serveFake(t, first, socket)
	p := newTestPlugin(t, &Args{Socket: socket})
	pod := makePod("p").gpu("1").obj()
	ctx := context.Background()

	state := reservedOnN1(t, p, pod)
	// The server goes away with Reserve unanswered: the binding cycle fails it as a transport
	// failure (the pod is retried), never binds it.
	stop()
	close(gate)
	if st := p.PreBind(ctx, state, pod, "n1"); st.Code() != fwk.Error || !strings.Contains(st.Message(), "tessera plugin server unavailable: Reserve") {
		t.Errorf("PreBind = %v, want the Reserve's transport failure", st)
	}

	// A new server on the same socket: the next cycle opens a new stream.
	second := &fakeServer{calls: map[string]int{}, preFilter: okResponse()}
	serveFake(t, second, socket)
	var st *fwk.Status
	for range 50 { // grpc reconnects with backoff; each PreFilter fails fast until then
		if _, st = p.PreFilter(ctx, newState(), pod, nil); st.IsSuccess() {
			break
		}
	}
	if !st.IsSuccess() || second.count("PreFilter") == 0 {
		t.Fatalf("PreFilter after the restart = %v (%d calls)", st, second.count("PreFilter"))
	}
}

func TestCycleAnswerWithoutTheCallsAnswerIsAServerFailure(t *testing.T) {
	fake, p := startFake(t, nil)
	fake.set(func(s *fakeServer) { s.emptyCycleAnswers = true })
	pod := makePod("p").gpu("1").obj()
	_, st := p.PreFilter(context.Background(), newState(), pod, nil)
	if st.Code() != fwk.Error || !strings.Contains(st.Message(), "tessera plugin server failed PreFilter: PreFilter answered OK without an answer") {
		t.Errorf("PreFilter = %v", st)
	}
	// Reserve's empty answer fails the binding cycle the same way.
	fake.set(func(s *fakeServer) { s.emptyCycleAnswers, s.preFilter = false, okResponse() })
	state := newState()
	if _, st := p.PreFilter(context.Background(), state, pod, nil); !st.IsSuccess() {
		t.Fatalf("PreFilter = %v", st)
	}
	fake.set(func(s *fakeServer) { s.emptyCycleAnswers = true })
	if st := p.Reserve(context.Background(), state, pod, "n1"); !st.IsSuccess() {
		t.Fatalf("Reserve = %v", st)
	}
	if st := p.PreBind(context.Background(), state, pod, "n1"); st.Code() != fwk.Error || !strings.Contains(st.Message(), "Reserve answered OK without an answer") {
		t.Errorf("PreBind = %v", st)
	}
}

// reservedOnN1 runs pod's PreFilter and Reserve on node n1 in a new cycle state.
func reservedOnN1(t *testing.T, p *Plugin, pod *v1.Pod) fwk.CycleState {
	t.Helper()
	state := newState()
	if _, st := p.PreFilter(context.Background(), state, pod, nil); !st.IsSuccess() {
		t.Fatalf("PreFilter(%s) = %v", pod.Name, st)
	}
	if st := p.Reserve(context.Background(), state, pod, "n1"); !st.IsSuccess() {
		t.Fatalf("Reserve(%s) = %v", pod.Name, st)
	}
	return state
}

// holdReserves makes p's stream hold a Reserve back for window.
func holdReserves(p *Plugin, window time.Duration) {
	p.cycle.mu.Lock()
	defer p.cycle.mu.Unlock()
	p.cycle.window = window
}

// startHolding starts a fake server whose PreFilter places pods (handling before unless
// noBefore) and a plugin whose stream holds a Reserve back for window.
func startHolding(t *testing.T, window time.Duration, noBefore bool) (*fakeServer, *Plugin) {
	t.Helper()
	fake, p := startFake(t, nil)
	fake.set(func(s *fakeServer) { s.preFilter, s.noBefore = okResponse(), noBefore })
	holdReserves(p, window)
	return fake, p
}

func TestReserveTravelsWithTheNextPreFilter(t *testing.T) {
	fake, p := startHolding(t, time.Hour, false) // only the next PreFilter sends it
	ctx := context.Background()
	a, b := makePod("a").gpu("1").obj(), makePod("b").gpu("1").obj()

	first := reservedOnN1(t, p, a)
	if _, st := p.PreFilter(ctx, newState(), b, nil); !st.IsSuccess() {
		t.Fatalf("PreFilter(b) = %v", st)
	}
	// a's binding cycle reads the answer that came with b's PreFilter.
	if st := p.PreBind(ctx, first, a, "n1"); !st.IsSuccess() {
		t.Fatalf("PreBind(a) = %v", st)
	}
	fake.mu.Lock()
	defer fake.mu.Unlock()
	if fake.cycleMessages != 2 {
		t.Errorf("Cycle messages = %d, want 2 (PreFilter(a), then Reserve(a) with PreFilter(b))", fake.cycleMessages)
	}
	if want := []string{"PreFilter", "Reserve", "PreFilter", "PreBind"}; !slices.Equal(fake.order, want) {
		t.Errorf("server handled %v, want %v (the Reserve before the PreFilter that carried it)", fake.order, want)
	}
}

func TestHeldReserveGoesAloneWhenNoPreFilterFollows(t *testing.T) {
	fake, p := startHolding(t, 5*time.Millisecond, false)
	ctx := context.Background()
	pod := makePod("p").gpu("1").obj()
	state := reservedOnN1(t, p, pod)
	if st := p.PreBind(ctx, state, pod, "n1"); !st.IsSuccess() {
		t.Fatalf("PreBind = %v (the window's timer sends the held Reserve)", st)
	}
	if n := fake.count("Reserve"); n != 1 {
		t.Errorf("Reserve calls = %d, want 1", n)
	}
}

func TestUnreserveSendsAHeldReserveFirst(t *testing.T) {
	fake, p := startHolding(t, time.Hour, false)
	ctx := context.Background()
	pod := makePod("p").gpu("1").obj()
	state := reservedOnN1(t, p, pod)
	done := make(chan struct{})
	go func() {
		p.Unreserve(ctx, state, pod, "n1")
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Unreserve waited for the window instead of sending the held Reserve")
	}
	fake.mu.Lock()
	defer fake.mu.Unlock()
	if want := []string{"PreFilter", "Reserve", "Unreserve"}; !slices.Equal(fake.order, want) {
		t.Errorf("server handled %v, want %v (the Reserve counted before it is released)", fake.order, want)
	}
}

func TestNoReserveIsHeldForAServerThatDoesNotHandleBefore(t *testing.T) {
	fake, p := startHolding(t, time.Hour, true)
	ctx := context.Background()
	pod := makePod("p").gpu("1").obj()
	state := reservedOnN1(t, p, pod)
	if st := p.PreBind(ctx, state, pod, "n1"); !st.IsSuccess() {
		t.Fatalf("PreBind = %v (the Reserve must have gone at once)", st)
	}
	fake.mu.Lock()
	defer fake.mu.Unlock()
	if fake.cycleMessages != 2 {
		t.Errorf("Cycle messages = %d, want 2 (each call alone)", fake.cycleMessages)
	}
}

func TestClosingTheStreamFailsAHeldReserve(t *testing.T) {
	fake, p := startHolding(t, time.Hour, false)
	ctx := context.Background()
	pod := makePod("p").gpu("1").obj()
	state := reservedOnN1(t, p, pod)
	p.cycle.Close()
	if st := p.PreBind(ctx, state, pod, "n1"); st.IsSuccess() {
		t.Error("PreBind succeeded with a Reserve that was never sent")
	}
	if n := fake.count("Reserve"); n != 0 {
		t.Errorf("Reserve calls = %d, want 0", n)
	}
}

// A server that does not handle before may replace one that did (a rollback): the new stream
// holds nothing back until its server says it handles before.
func TestAReopenedStreamHoldsNothingUntilItsServerHandlesBefore(t *testing.T) {
	socket := filepath.Join(t.TempDir(), "plugin.sock")
	first := &fakeServer{calls: map[string]int{}, preFilter: okResponse()}
	stop := serveFake(t, first, socket)
	p := newTestPlugin(t, &Args{Socket: socket})
	holdReserves(p, time.Hour)
	ctx := context.Background()
	pod := makePod("p").gpu("1").obj()
	if _, st := p.PreFilter(ctx, newState(), pod, nil); !st.IsSuccess() {
		t.Fatalf("PreFilter = %v", st)
	}
	stop()

	older := &fakeServer{calls: map[string]int{}, preFilter: okResponse(), noBefore: true}
	serveFake(t, older, socket)
	state := newState()
	var st *fwk.Status
	for range 50 { // grpc reconnects with backoff; each PreFilter fails fast until then
		if _, st = p.PreFilter(ctx, state, pod, nil); st.IsSuccess() {
			break
		}
	}
	if !st.IsSuccess() {
		t.Fatalf("PreFilter on the new server = %v", st)
	}
	if st := p.Reserve(ctx, state, pod, "n1"); !st.IsSuccess() {
		t.Fatalf("Reserve = %v", st)
	}
	done := make(chan *fwk.Status, 1)
	go func() { done <- p.PreBind(ctx, state, pod, "n1") }()
	select {
	case st := <-done:
		if !st.IsSuccess() {
			t.Fatalf("PreBind = %v", st)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the Reserve was held for a server that never said it handles before")
	}
	if n := older.count("Reserve"); n != 1 {
		t.Errorf("the new server got %d Reserves, want 1", n)
	}
}
