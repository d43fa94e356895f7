package tessera

import (
	"context"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"
)

// activations receives the pods Activate was called with (from retryIfStale's timer).
type activations struct {
	fwk.Handle
	got chan string
}

func (a *activations) Activate(_ klog.Logger, pods map[string]*v1.Pod) {
	for k := range pods {
		a.got <- k
	}
}

func TestAFailedCycleRightAfterANodeEventIsRetriedOnce(t *testing.T) {
	for _, tc := range []struct {
		name      string
		eventAgo  time.Duration // before PreFilter asked; negative: after
		wantRetry bool
	}{
		{"event just before the cycle", 100 * time.Millisecond, true},
		{"event during the cycle", -50 * time.Millisecond, true},
		{"event long before the cycle", staleWindow + time.Second, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := &activations{got: make(chan string, 4)}
			p := &Plugin{handle: h}
			asked := time.Now()
			p.events.seen(asked.Add(-tc.eventAgo))
			state := newState()
			state.Write(askedKey, askedAt(asked))
			if got := p.retryIfStale(context.Background(), state, makePod("late").obj()); got != tc.wantRetry {
				t.Errorf("retryIfStale = %v, want %v", got, tc.wantRetry)
			}
			select {
			case key := <-h.got:
				if !tc.wantRetry {
					t.Fatalf("retried %s, want no retry", key)
				}
				if key != "default/late" {
					t.Fatalf("activated %q, want default/late", key)
				}
			case <-time.After(staleRetry + 2*time.Second):
				if tc.wantRetry {
					t.Fatal("no retry within the retry delay")
				}
			}
		})
	}
}

func TestTheNodeEventHintQueuesAndRemembersTheTime(t *testing.T) {
	p := &Plugin{}
	before := time.Now()
	hint, err := p.nodeChanged(klog.Background(), makePod("p").obj(), nil, nil)
	if err != nil || hint != fwk.Queue {
		t.Fatalf("hint %v, %v; want Queue", hint, err)
	}
	if p.events.last().Before(before) {
		t.Fatalf("last node event %v, want at or after %v", p.events.last(), before)
	}
}

func TestNoRetryWithoutAnAskedTime(t *testing.T) {
	h := &activations{got: make(chan string, 1)}
	p := &Plugin{handle: h}
	p.events.seen(time.Now())
	p.retryIfStale(context.Background(), newState(), makePod("skipped").obj())
	select {
	case key := <-h.got:
		t.Fatalf("retried %s although PreFilter never asked the server", key)
	case <-time.After(staleRetry + 500*time.Millisecond):
	}
}

func TestAGPUPodChangeCountsAsAnEventTheServerMayLagOn(t *testing.T) {
	fake, p := startFake(t, nil)
	_ = fake
	before := time.Now()
	rejected := makePod("waiting").gpu("1").obj()
	gone := makePod("victim").gpu("1").obj()
	if hint, err := p.isGPUPodChange(klog.Background(), rejected, gone, nil); err != nil || hint != fwk.Queue {
		t.Fatalf("hint %v, %v; want Queue", hint, err)
	}
	if p.events.last().Before(before) {
		t.Fatal("a GPU pod's deletion was not remembered for retryIfStale")
	}
	p.events.seen(time.Time{})
	cpuOnly := makePod("cpu-only").obj()
	if hint, _ := p.isGPUPodChange(klog.Background(), rejected, cpuOnly, nil); hint != fwk.QueueSkip {
		t.Fatalf("hint %v for a pod without GPUs, want QueueSkip", hint)
	}
	if !p.events.last().Before(before) {
		t.Fatal("a pod without GPUs counted as an event the server may lag on")
	}
}

func TestANominatedPodDoesNotPreemptAgainWhileTheServerMayLag(t *testing.T) {
	nominated := makePod("preemptor").gpu("1").obj()
	nominated.Status.NominatedNodeName = "n1"
	if st := preemptedJustNow(nominated, true); st.Code() != fwk.UnschedulableAndUnresolvable ||
		!strings.Contains(st.Message(), "n1") {
		t.Errorf("right after its victims changed: %v %q, want UnschedulableAndUnresolvable naming n1", st.Code(), st.Message())
	}
	if st := preemptedJustNow(nominated, false); st != nil {
		t.Errorf("with no recent GPU pod event: %v, want nil (preemption may run)", st)
	}
	if st := preemptedJustNow(makePod("fresh").gpu("1").obj(), true); st != nil {
		t.Errorf("a pod never nominated: %v, want nil", st)
	}
}
