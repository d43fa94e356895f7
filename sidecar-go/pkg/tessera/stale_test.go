package tessera

import (
	"context"
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
			p.nodeEvents.seen(asked.Add(-tc.eventAgo))
			state := newState()
			state.Write(askedKey, askedAt(asked))
			p.retryIfStale(context.Background(), state, makePod("late").obj())
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
	if p.nodeEvents.last().Before(before) {
		t.Fatalf("last node event %v, want at or after %v", p.nodeEvents.last(), before)
	}
}

func TestNoRetryWithoutAnAskedTime(t *testing.T) {
	h := &activations{got: make(chan string, 1)}
	p := &Plugin{handle: h}
	p.nodeEvents.seen(time.Now())
	p.retryIfStale(context.Background(), newState(), makePod("skipped").obj())
	select {
	case key := <-h.got:
		t.Fatalf("retried %s although PreFilter never asked the server", key)
	case <-time.After(staleRetry + 500*time.Millisecond):
	}
}
