package tessera

import (
	"context"
	"sync/atomic"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"
)

// kube-scheduler's informer and the plugin server's watch see a node change independently.
// A node event requeues the pods Tessera rejected at once, and the cycle that follows may
// reach the server before its watch has applied that same change (a GPU healthy again, a new
// node): the server then rejects the pod on the old state, and no later event requeues it
// (kube-scheduler would retry only after minutes). So a cycle that fails shortly after a
// node event asks for one more attempt a little later, when the server has caught up.
const (
	// staleWindow: how long after a node event a failed cycle may have been decided on the
	// server's older view of it.
	staleWindow = 2 * time.Second
	// staleRetry: when the extra attempt comes (the server's watch applies an event in
	// milliseconds; this leaves room for a busy machine).
	staleRetry = time.Second
)

const askedKey fwk.StateKey = Name + "/asked"

// askedAt is when PreFilter asked the server in this cycle (never mutated: Clone shares it).
type askedAt time.Time

// Clone implements fwk.StateData.
func (a askedAt) Clone() fwk.StateData { return a }

// nodeEventClock holds when the last node event that could requeue a rejected pod arrived.
type nodeEventClock struct{ unixNano atomic.Int64 }

func (c *nodeEventClock) seen(now time.Time) { c.unixNano.Store(now.UnixNano()) }

func (c *nodeEventClock) last() time.Time { return time.Unix(0, c.unixNano.Load()) }

// nodeChanged is the node events' queueing hint: every registered node change requeues (as
// before), and its time is kept for retryIfStale.
func (p *Plugin) nodeChanged(_ klog.Logger, _ *v1.Pod, _, _ interface{}) (fwk.QueueingHint, error) {
	p.nodeEvents.seen(time.Now())
	return fwk.Queue, nil
}

// retryIfStale asks for one more attempt of a pod whose cycle failed within staleWindow of a
// node event (see above); at most one per failed cycle.
func (p *Plugin) retryIfStale(ctx context.Context, state fwk.CycleState, pod *v1.Pod) {
	data, err := state.Read(askedKey)
	if err != nil || p.handle == nil {
		return
	}
	asked, ok := data.(askedAt)
	if !ok || p.nodeEvents.last().Before(time.Time(asked).Add(-staleWindow)) {
		return
	}
	logger := klog.FromContext(ctx)
	key := pod.Namespace + "/" + pod.Name
	time.AfterFunc(staleRetry, func() {
		p.handle.Activate(logger, map[string]*v1.Pod{key: pod})
	})
}
