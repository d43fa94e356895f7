package tessera

import (
	"context"
	"fmt"
	"slices"

	v1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"
	"k8s.io/kubernetes/pkg/scheduler/apis/config"
	"k8s.io/kubernetes/pkg/scheduler/framework/plugins/names"

	"tessera/sidecar-go/pkg/pluginv1"
)

// Filter compares the node against the verdict PreFilter stored. A node that does not fit is
// Unschedulable only where preemption may help (PreFilter's preemptible nodes), so
// DefaultPreemption dry-runs those alone; every other one is UnschedulableAndUnresolvable.
// Only in that dry run, on a preemptible node some of whose GPU pods count as gone, does it
// ask the server (FilterWhatIf, whatif.go).
func (p *Plugin) Filter(ctx context.Context, state fwk.CycleState, pod *v1.Pod, nodeInfo fwk.NodeInfo) *fwk.Status {
	d, err := readDecision(state)
	if err != nil {
		// The framework skips Filter when PreFilter returned Skip, so this is misconfiguration.
		return fwk.AsStatus(fmt.Errorf("%s Filter without a PreFilter decision (enable %s at preFilter too): %w", Name, Name, err))
	}
	node := nodeInfo.Node().Name
	if _, ok := d.scores[node]; ok {
		return nil
	}
	if !d.preemptible.Has(node) {
		// It would not fit even without every lower-priority pod: nothing to preempt here.
		return fwk.NewStatus(fwk.UnschedulableAndUnresolvable, d.rejection())
	}
	if w := readWhatIf(state, node); w.frees() {
		return p.filterWhatIf(ctx, state, pod, d, node, w)
	}
	return fwk.NewStatus(fwk.Unschedulable, d.rejection())
}

// genericInfeasible is a rejected node's Filter message when PreFilter found other nodes that
// fit (the server then leaves the explanation to PostFilter).
const genericInfeasible = "Tessera: the pod's GPU request does not fit"

// PostFilter runs only when no node passed every Filter. If Tessera found nodes that fit (and
// so explained nothing yet), it asks the server why the others do not; the answer joins the
// pod's PodScheduled message after kube-scheduler's per-plugin counts. It never nominates a
// node: preemption is DefaultPreemption's, which the profile lists after Tessera. Tessera
// answers Unschedulable, so kube-scheduler goes on to DefaultPreemption, except when other
// plugins rejected only the best candidates: then UnschedulableAndUnresolvable stops it, as
// the pod is retried at once with every feasible node and evicting pods for it would be
// premature.
func (p *Plugin) PostFilter(ctx context.Context, state fwk.CycleState, pod *v1.Pod, _ fwk.NodeToStatusReader) (*fwk.PostFilterResult, *fwk.Status) {
	p.checkPreemptsAfter(ctx)
	retrying := p.retryIfStale(ctx, state, pod)
	if st := preemptedJustNow(pod, retrying); st != nil {
		return nil, st
	}
	d, err := readDecision(state)
	if err != nil {
		return nil, fwk.NewStatus(fwk.Unschedulable)
	}
	if d.feasibleTotal > 0 || d.hostOnly {
		// Other plugins rejected every candidate: try again at once with every feasible node
		// (a pod without a GPU: kube-scheduler alone, its preemption included).
		p.wide.add(pod.UID)
		if p.handle != nil {
			p.handle.Activate(klog.FromContext(ctx), map[string]*v1.Pod{pod.Namespace + "/" + pod.Name: pod})
		}
		if d.hostOnly {
			return nil, fwk.NewStatus(fwk.UnschedulableAndUnresolvable, fmt.Sprintf(
				"Tessera: other plugins rejected the %d nodes it offered; kube-scheduler places the pod alone next",
				len(d.scores)))
		}
		return nil, fwk.NewStatus(fwk.UnschedulableAndUnresolvable, fmt.Sprintf(
			"Tessera: other plugins rejected the %d best of %d nodes that fit the GPU request; trying all of them next",
			len(d.scores), d.feasibleTotal))
	}
	if d.infeasibleMessage != "" {
		return nil, fwk.NewStatus(fwk.Unschedulable)
	}
	callCtx, cancel := context.WithTimeout(ctx, p.args.Timeout.Duration)
	defer cancel()
	resp, err := p.client.Explain(callCtx, &pluginv1.ExplainRequest{
		Version:    pluginv1.ProtocolVersion_PROTOCOL_VERSION_1,
		Pod:        podRef(pod),
		DecisionId: d.id,
	})
	if err != nil {
		// Only the explanation is lost; the pod stays Pending either way.
		return nil, fwk.NewStatus(fwk.Unschedulable, describeRPCError("Explain", p.args.Timeout.Duration, err).Error())
	}
	if resp.GetMessage() == "" { // every node fits the GPU request: others rejected them
		return nil, fwk.NewStatus(fwk.Unschedulable)
	}
	return nil, fwk.NewStatus(fwk.Unschedulable, "Tessera: "+resp.GetMessage())
}

// checkPreemptsAfter logs once if this profile's DefaultPreemption does not run after
// Tessera's PostFilter: GPU pods then never preempt (absent), or preemption may evict pods
// for a pod whose retry with every feasible node would place it (listed first).
func (p *Plugin) checkPreemptsAfter(ctx context.Context) {
	p.postFilterOrder.Do(func() {
		lister, ok := p.handle.(pluginLister)
		if !ok {
			return
		}
		enabled := lister.ListPlugins().PostFilter.Enabled
		self := slices.IndexFunc(enabled, func(pl config.Plugin) bool { return pl.Name == Name })
		preemption := slices.IndexFunc(enabled, func(pl config.Plugin) bool { return pl.Name == names.DefaultPreemption })
		switch {
		case preemption < 0:
			klog.FromContext(ctx).Info("DefaultPreemption is not a postFilter plugin of this profile: GPU pods never preempt; "+
				"see examples/scheduler-config.yaml", "plugin", Name, "postFilterPlugins", enabled)
		case preemption < self:
			klog.FromContext(ctx).Info("DefaultPreemption runs before Tessera's PostFilter: it may evict pods for a GPU pod "+
				"that Tessera would retry at once with every feasible node; see examples/scheduler-config.yaml",
				"plugin", Name, "postFilterPlugins", enabled)
		}
	})
}
