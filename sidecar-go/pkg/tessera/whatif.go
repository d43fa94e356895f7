package tessera

// Preemption's what-ifs. kube-scheduler's DefaultPreemption dry-runs each node whose Filter said
// Unschedulable (for Tessera: PreFilter's preemptible nodes): on a clone of the cycle's state it
// removes the pod's lower-priority pods (PreFilterExtensions.RemovePod), runs the filters, then
// adds the victims back one by one (AddPod), keeping those that still let the pod fit. Every
// Filter run also adds the node's nominated pods of at least the pod's priority (AddPod, on
// another clone). AddPod and RemovePod only record which pods count as gone or added on which
// node, with no RPC; Filter asks the server (FilterWhatIf) whether the pod fits that what-if.

import (
	"context"
	"errors"
	"maps"
	"slices"
	"sync/atomic"

	v1 "k8s.io/api/core/v1"
	fwk "k8s.io/kube-scheduler/framework"

	"tessera/sidecar-go/pkg/pluginv1"
)

const whatIfKey fwk.StateKey = Name + "/whatif"

// whatIfs holds each node's what-if. A stored value is never changed (but for the server's
// answer to it, the same for every holder): AddPod and RemovePod store a changed copy
// (copy-on-write), so the CycleState clones that share a value (preemption clones the state
// per node and per Filter run with nominated pods) never see one another's later changes, and
// Clone need not copy.
type whatIfs map[string]*whatIf

// Clone implements fwk.StateData.
func (all whatIfs) Clone() fwk.StateData { return all }

// with is all with node's what-if replaced by w.
func (all whatIfs) with(node string, w *whatIf) whatIfs {
	out := make(whatIfs, len(all)+1)
	maps.Copy(out, all)
	out[node] = w
	return out
}

// whatIf is what counts as changed on one node; nil means nothing. Each pod appears at most
// once: a victim added back cancels its removal (it holds its devices as before), and a pod
// removed after being added cancels its addition.
type whatIf struct {
	// removed are the UIDs of the node's pods that count as gone, in the order removed.
	removed []string
	// added are pods that count as placed besides the node's own (nominated pods), in order.
	added []*v1.Pod
	// answer is the server's, once asked: the same what-if asked again (after a victim
	// without Tessera resources was added back) costs no RPC.
	answer atomic.Pointer[pluginv1.FilterWhatIfResponse]
}

// frees says whether the what-if may make room: only removing pods can.
func (w *whatIf) frees() bool { return w != nil && len(w.removed) > 0 }

func (w *whatIf) parts() ([]string, []*v1.Pod) {
	if w == nil {
		return nil, nil
	}
	return w.removed, w.added
}

// add is w with pod counted as placed; w itself when nothing changes.
func (w *whatIf) add(pod *v1.Pod) *whatIf {
	removed, added := w.parts()
	uid := string(pod.UID)
	switch {
	case slices.Contains(removed, uid):
		return &whatIf{removed: without(removed, uid), added: added}
	case slices.ContainsFunc(added, hasUID(uid)):
		return w
	}
	// Clip: append never writes into an array another what-if shares.
	return &whatIf{removed: removed, added: append(slices.Clip(added), pod)}
}

// remove is w with pod counted as gone; w itself when nothing changes.
func (w *whatIf) remove(pod *v1.Pod) *whatIf {
	removed, added := w.parts()
	uid := string(pod.UID)
	switch {
	case slices.ContainsFunc(added, hasUID(uid)):
		return &whatIf{removed: removed, added: slices.DeleteFunc(slices.Clone(added), hasUID(uid))}
	case slices.Contains(removed, uid):
		return w
	}
	return &whatIf{removed: append(slices.Clip(removed), uid), added: added}
}

func without(uids []string, uid string) []string {
	return slices.DeleteFunc(slices.Clone(uids), func(u string) bool { return u == uid })
}

func hasUID(uid string) func(*v1.Pod) bool {
	return func(p *v1.Pod) bool { return string(p.UID) == uid }
}

func readWhatIfs(state fwk.CycleState) whatIfs {
	data, err := state.Read(whatIfKey)
	if err != nil {
		return nil
	}
	all, _ := data.(whatIfs)
	return all
}

// readWhatIf is node's what-if in state, or nil.
func readWhatIf(state fwk.CycleState, node string) *whatIf { return readWhatIfs(state)[node] }

// AddPod records, for preemption's what-if on a preemptible node, a pod that counts as placed
// there: a victim added back, or a nominated pod. Cheap; no RPC.
func (p *Plugin) AddPod(_ context.Context, state fwk.CycleState, _ *v1.Pod, podInfo fwk.PodInfo, nodeInfo fwk.NodeInfo) *fwk.Status {
	return p.recordWhatIf(state, podInfo, nodeInfo, (*whatIf).add)
}

// RemovePod records, for preemption's what-if on a preemptible node, a pod that counts as gone.
// Cheap; no RPC.
func (p *Plugin) RemovePod(_ context.Context, state fwk.CycleState, _ *v1.Pod, podInfo fwk.PodInfo, nodeInfo fwk.NodeInfo) *fwk.Status {
	return p.recordWhatIf(state, podInfo, nodeInfo, (*whatIf).remove)
}

// recordWhatIf applies change to the node's what-if. Only preemptible nodes keep one (Filter
// reads none elsewhere: a feasible node stays feasible, as it did before preemption existed,
// and any other node would not fit even without every lower-priority pod), and only pods with
// Tessera resources change anything on GPUs.
func (p *Plugin) recordWhatIf(state fwk.CycleState, podInfo fwk.PodInfo, nodeInfo fwk.NodeInfo, change func(*whatIf, *v1.Pod) *whatIf) *fwk.Status {
	if podInfo == nil || nodeInfo == nil || nodeInfo.Node() == nil {
		return nil
	}
	d, err := readDecision(state)
	if errors.Is(err, errNoDecision) {
		return nil
	}
	if err != nil {
		return fwk.AsStatus(err)
	}
	node, pod := nodeInfo.Node().Name, podInfo.GetPod()
	if !d.preemptible.Has(node) || !p.resources.requested(pod) {
		return nil
	}
	all := readWhatIfs(state)
	if w, changed := all[node], change(all[node], pod); changed != w {
		state.Write(whatIfKey, all.with(node, changed))
	}
	return nil
}

// filterWhatIf is Filter's answer on a preemptible node under a what-if that removes pods: the
// server's. A failed call is Unschedulable (the node is no candidate this time), never Success:
// the pod would be nominated to a node nobody checked.
func (p *Plugin) filterWhatIf(ctx context.Context, state fwk.CycleState, pod *v1.Pod, d *decision, node string, w *whatIf) *fwk.Status {
	resp := w.answer.Load()
	if resp == nil {
		var err error
		if resp, err = p.askWhatIf(ctx, state, pod, d, node, w); err != nil {
			return fwk.NewStatus(fwk.Unschedulable, err.Error())
		}
		w.answer.Store(resp)
	}
	if resp.GetFits() {
		return nil
	}
	if msg := resp.GetMessage(); msg != "" {
		return fwk.NewStatus(fwk.Unschedulable, msg)
	}
	return fwk.NewStatus(fwk.Unschedulable, d.rejection())
}

func (p *Plugin) askWhatIf(ctx context.Context, state fwk.CycleState, pod *v1.Pod, d *decision, node string, w *whatIf) (*pluginv1.FilterWhatIfResponse, error) {
	added := make([][]byte, 0, len(w.added))
	for _, a := range w.added {
		b, err := encodePod(a)
		if err != nil {
			return nil, err
		}
		added = append(added, b)
	}
	ctx, traced := p.tracing.startWhatIf(ctx, state, pod, node)
	callCtx, cancel := context.WithTimeout(ctx, p.args.Timeout.Duration)
	defer cancel()
	resp, err := p.client.FilterWhatIf(callCtx, &pluginv1.FilterWhatIfRequest{
		Version:        pluginv1.ProtocolVersion_PROTOCOL_VERSION_1,
		Pod:            podRef(pod),
		DecisionId:     d.id,
		PodJson:        d.podJSON,
		Node:           node,
		RemovedPodUids: w.removed,
		AddedPodsJson:  added,
	})
	if err != nil {
		traced.end(OutcomeError, err)
		return nil, describeRPCError("FilterWhatIf", p.args.Timeout.Duration, err)
	}
	outcome := OutcomeOK
	if !resp.GetFits() {
		outcome = OutcomeUnschedulable
	}
	traced.end(outcome, nil)
	return resp, nil
}
