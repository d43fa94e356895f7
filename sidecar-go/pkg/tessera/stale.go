package tessera

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"
)

// kube-scheduler's informer and the plugin server's watch see a change independently. A node
// event or a GPU pod's change (deleted: a preemption victim gone) requeues the pods Tessera
// rejected at once, and the cycle that follows may reach the server before its watch has
// applied that same change (a GPU healthy again, a new node, a pod's devices freed): the
// server then rejects the pod on the old state, and no later event requeues it
// (kube-scheduler would retry only after minutes). So a cycle that fails shortly after such
// an event asks for one more attempt a little later, when the server has caught up.
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

// eventClock holds when the last event that could requeue a rejected pod arrived.
type eventClock struct{ unixNano atomic.Int64 }

func (c *eventClock) seen(now time.Time) { c.unixNano.Store(now.UnixNano()) }

func (c *eventClock) last() time.Time { return time.Unix(0, c.unixNano.Load()) }

// nodeChanged is the node events' queueing hint: every registered node change requeues (as
// before), and its time is kept for retryIfStale.
func (p *Plugin) nodeChanged(_ klog.Logger, _ *v1.Pod, _, _ interface{}) (fwk.QueueingHint, error) {
	p.events.seen(time.Now())
	return fwk.Queue, nil
}

// retryIfStale asks for one more attempt of a pod whose cycle failed within staleWindow of a
// node or GPU pod event (see above), at most one per failed cycle; whether it did.
func (p *Plugin) retryIfStale(ctx context.Context, state fwk.CycleState, pod *v1.Pod) bool {
	data, err := state.Read(askedKey)
	if err != nil || p.handle == nil {
		return false
	}
	asked, ok := data.(askedAt)
	if !ok || p.events.last().Before(time.Time(asked).Add(-staleWindow)) {
		return false
	}
	logger := klog.FromContext(ctx)
	key := pod.Namespace + "/" + pod.Name
	time.AfterFunc(staleRetry, func() {
		p.handle.Activate(logger, map[string]*v1.Pod{key: pod})
	})
	return true
}

// preemptedJustNow: the pod was nominated by a preemption and the cycle failed right after
// GPU pods changed (its victims deleted, in kube-scheduler's view). The plugin server may not
// have seen them gone yet, and a dry run now would find "victims" among the pods that stay:
// preempting again waits for the retry, when the server has caught up.
func preemptedJustNow(pod *v1.Pod, retrying bool) *fwk.Status {
	if !retrying || pod.Status.NominatedNodeName == "" {
		return nil
	}
	return fwk.NewStatus(fwk.UnschedulableAndUnresolvable, fmt.Sprintf(
		"Tessera: waiting for its preemption's victims on %s to be gone before preempting again",
		pod.Status.NominatedNodeName))
}
