package tessera

import (
	"context"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	fwk "k8s.io/kube-scheduler/framework"
)

// decided runs a successful PreFilter so the state holds decision 42.
func decided(t *testing.T, fake *fakeServer, p *Plugin) fwk.CycleState {
	t.Helper()
	fake.set(func(s *fakeServer) { s.preFilter, s.err = okResponse(), nil })
	state := newState()
	if _, st := p.PreFilter(context.Background(), state, makePod("p").gpu("1").obj(), nil); !st.IsSuccess() {
		t.Fatalf("PreFilter = %v", st)
	}
	return state
}

func TestReserveSendsDecisionAndMapsErrors(t *testing.T) {
	fake, p := startFake(t, nil)
	pod := makePod("p").gpu("1").obj()
	ctx := context.Background()

	state := decided(t, fake, p)
	if st := p.Reserve(ctx, state, pod, "n2"); !st.IsSuccess() {
		t.Fatalf("Reserve = %v", st)
	}
	if st := p.PreBind(ctx, state, pod, "n2"); !st.IsSuccess() {
		t.Fatalf("PreBind = %v", st)
	}
	if _, r, _, _ := fake.last(); r.GetNode() != "n2" || r.GetDecisionId() != 42 || r.GetPod().GetUid() != "uid-p" {
		t.Errorf("ReserveRequest = %v", r)
	}

	// The answer is read in the binding cycle: PreBind (and Bind) fail as Reserve would have.
	cases := []struct {
		name     string
		err      error
		wantCode fwk.Code
		wantMsg  string
	}{
		{"node taken meanwhile", status.Error(codes.Aborted, "GPU-1 full"), fwk.Unschedulable, "node n2 no longer fits: GPU-1 full"},
		{"server down", status.Error(codes.Unavailable, "connection refused"), fwk.Error, "tessera plugin server unavailable: Reserve"},
		{"server error", status.Error(codes.Internal, "boom"), fwk.Error, "tessera plugin server failed Reserve"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			state := decided(t, fake, p)
			fake.set(func(s *fakeServer) { s.err = tc.err })
			if st := p.Reserve(ctx, state, pod, "n2"); !st.IsSuccess() {
				t.Fatalf("Reserve = %v, want Success (the answer is read in the binding cycle)", st)
			}
			if _, st := p.PreBindPreFlight(ctx, state, pod, "n2"); !st.IsSuccess() {
				t.Errorf("PreBindPreFlight = %v, want Success (PreBind reports the failure)", st)
			}
			for _, step := range []struct {
				name string
				st   *fwk.Status
			}{{"PreBind", p.PreBind(ctx, state, pod, "n2")}, {"Bind", p.Bind(ctx, state, pod, "n2")}} {
				if step.st.Code() != tc.wantCode || !strings.Contains(step.st.Message(), tc.wantMsg) {
					t.Errorf("%s = %v %q, want %v containing %q", step.name, step.st.Code(), step.st.Message(), tc.wantCode, tc.wantMsg)
				}
			}
		})
	}
}

func TestReserveDoesNotWaitAndUnreserveFollowsItsAnswer(t *testing.T) {
	fake, p := startFake(t, nil)
	pod := makePod("p").gpu("1").obj()
	ctx := context.Background()
	state := decided(t, fake, p)
	gate := make(chan struct{})
	fake.set(func(s *fakeServer) { s.reserveGate = gate })

	// The server holds Reserve's answer: the scheduling cycle goes on regardless.
	if st := p.Reserve(ctx, state, pod, "n1"); !st.IsSuccess() {
		t.Fatalf("Reserve = %v", st)
	}
	unreserved := make(chan struct{})
	go func() {
		p.Unreserve(ctx, state, pod, "n1")
		close(unreserved)
	}()
	// Unreserve must not overtake the Reserve it releases: it waits for the answer. (A
	// broken one would reach the server within this pause; the correct one never needs it.)
	select {
	case <-unreserved:
		t.Error("Unreserve returned while the Reserve it releases was unanswered")
	case <-time.After(100 * time.Millisecond):
	}
	if got := fake.count("Unreserve"); got != 0 {
		t.Errorf("Unreserve reached the server before the Reserve it releases was answered (%d calls)", got)
	}
	close(gate)
	<-unreserved
	if got := fake.count("Unreserve"); got != 1 {
		t.Errorf("Unreserve calls = %d, want 1", got)
	}
}

func TestUnreserveCallsServerAndOnlyLogsErrors(t *testing.T) {
	fake, p := startFake(t, nil)
	pod := makePod("p").gpu("1").obj()
	state := decided(t, fake, p)

	p.Unreserve(context.Background(), state, pod, "n1")
	if _, _, r, _ := fake.last(); r.GetNode() != "n1" || r.GetPod().GetName() != "p" {
		t.Errorf("UnreserveRequest = %v", r)
	}
	fake.set(func(s *fakeServer) { s.err = status.Error(codes.Unavailable, "down") })
	p.Unreserve(context.Background(), state, pod, "n1") // must not panic or block
	if n := fake.count("Unreserve"); n != 2 {
		t.Errorf("Unreserve calls = %d, want 2 (each call forwarded; the server is idempotent)", n)
	}
}

func TestPreBindPersistsOrFailsWithError(t *testing.T) {
	fake, p := startFake(t, nil)
	pod := makePod("p").gpu("1").obj()
	ctx := context.Background()
	state := decided(t, fake, p)

	res, st := p.PreBindPreFlight(ctx, state, pod, "n1")
	if !st.IsSuccess() || res == nil || !res.AllowParallel {
		t.Errorf("PreBindPreFlight = %v, %v; want Success with AllowParallel", res, st)
	}
	if st := p.PreBind(ctx, state, pod, "n1"); !st.IsSuccess() {
		t.Fatalf("PreBind = %v", st)
	}
	if _, _, _, r := fake.last(); r.GetNode() != "n1" || r.GetPod().GetUid() != "uid-p" {
		t.Errorf("PreBindRequest = %v", r)
	}
	for _, err := range []error{status.Error(codes.Unavailable, "down"), status.Error(codes.Internal, "patch conflict")} {
		fake.set(func(s *fakeServer) { s.err = err })
		if st := p.PreBind(ctx, state, pod, "n1"); st.Code() != fwk.Error || !strings.Contains(st.Message(), "PreBind") {
			t.Errorf("PreBind with %v = %v %q, want Error naming PreBind", err, st.Code(), st.Message())
		}
	}
}

func TestPreBindAsksAgainWhileTheNodeIsStillAllocating(t *testing.T) {
	fake, p := startFake(t, &Args{BindTimeout: metav1.Duration{Duration: 5 * time.Second}})
	pod := makePod("p").gpu("1").obj()
	ctx := context.Background()
	state := decided(t, fake, p)
	fake.set(func(s *fakeServer) { s.bindWaits = 2 })
	if st := p.PreBind(ctx, state, pod, "n1"); !st.IsSuccess() {
		t.Fatalf("PreBind = %v, want success on the third call", st)
	}
	if n := fake.count("PreBind"); n != 3 {
		t.Errorf("PreBind calls = %d, want 3", n)
	}
	if n := fake.count("Unreserve"); n != 0 {
		t.Errorf("Unreserve calls = %d, want 0 (the reservation stands)", n)
	}
}

func TestPreBindGivesUpAskingAtItsDeadline(t *testing.T) {
	fake, p := startFake(t, &Args{BindTimeout: metav1.Duration{Duration: 700 * time.Millisecond}})
	pod := makePod("p").gpu("1").obj()
	state := decided(t, fake, p)
	fake.set(func(s *fakeServer) { s.bindWaits = 1 << 20 })
	start := time.Now()
	st := p.PreBind(context.Background(), state, pod, "n1")
	if st.Code() != fwk.Error || !strings.Contains(st.Message(), "node n1 still allocating an earlier pod after 700ms") {
		t.Errorf("PreBind = %v %q, want Error saying it gave up", st.Code(), st.Message())
	}
	if took := time.Since(start); took < 600*time.Millisecond || took > 3*time.Second {
		t.Errorf("gave up after %s, want about the bind timeout", took)
	}
	if n := fake.count("PreBind"); n < 2 || n > 6 {
		t.Errorf("PreBind calls = %d, want a few (paced, not a busy loop)", n)
	}
}

func TestPreBindCancelledByTheSchedulerIsUnschedulableNotAnError(t *testing.T) {
	fake, p := startFake(t, &Args{BindTimeout: metav1.Duration{Duration: 5 * time.Second}})
	pod := makePod("p").gpu("1").obj()
	state := decided(t, fake, p)
	fake.set(func(s *fakeServer) { s.bindWaits = 1 << 20 }) // waits until cancelled
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(300*time.Millisecond, cancel) // kube-scheduler preempts the waiting pod
	st := p.PreBind(ctx, state, pod, "n1")
	if st.Code() != fwk.Unschedulable || !strings.Contains(st.Message(), "preempted") {
		t.Errorf("PreBind = %v %q, want Unschedulable saying the binding was cancelled", st.Code(), st.Message())
	}
}
