package tessera

import (
	"context"
	"net"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/grpc"
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

	state := newState()
	if _, st := p.PreFilter(ctx, state, pod, nil); !st.IsSuccess() {
		t.Fatalf("PreFilter = %v", st)
	}
	if st := p.Reserve(ctx, state, pod, "n1"); !st.IsSuccess() {
		t.Fatalf("Reserve = %v", st)
	}
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
