package tessera

import (
	"sync"

	"k8s.io/apimachinery/pkg/types"
)

// wideLimit bounds wideSet; past it the set starts over (a pod then gets one more attempt
// with candidates first, whose failure adds it back).
const wideLimit = 10000

// wideSet holds the pods that get every feasible node: an attempt with only the best
// candidates found all of them rejected by other plugins. Safe for concurrent use; the
// zero value is empty.
type wideSet struct {
	mu   sync.Mutex
	pods map[types.UID]struct{}
}

func (w *wideSet) add(uid types.UID) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.pods == nil || len(w.pods) >= wideLimit {
		w.pods = map[types.UID]struct{}{}
	}
	w.pods[uid] = struct{}{}
}

func (w *wideSet) has(uid types.UID) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	_, ok := w.pods[uid]
	return ok
}

func (w *wideSet) remove(uid types.UID) {
	w.mu.Lock()
	defer w.mu.Unlock()
	delete(w.pods, uid)
}
