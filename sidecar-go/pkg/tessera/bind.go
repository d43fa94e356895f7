package tessera

import (
	"context"
	"fmt"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"
	"k8s.io/kubernetes/pkg/scheduler/apis/config"
)

const bindKey fwk.StateKey = Name + "/bind"

// handedOver holds the annotations (and pod labels) the server handed over for Bind to write.
type handedOver struct{ annotations, labels map[string]string }

// Clone implements fwk.StateData; the map is never mutated after PreBind.
func (h *handedOver) Clone() fwk.StateData { return h }

// pluginLister is the part of kube-scheduler's framework that says which plugins run where.
type pluginLister interface{ ListPlugins() *config.Plugins }

// bindsFirst says whether Tessera's Bind runs before any other bind plugin in this profile
// (asked once, at the first PreBind, when the framework is complete). Only then may PreBind
// leave the annotations to Bind; otherwise DefaultBinder would bind the pod without them.
func (p *Plugin) bindsFirst(ctx context.Context) bool {
	p.bindOrder.Do(func() {
		lister, ok := p.handle.(pluginLister)
		if !ok {
			return
		}
		bind := lister.ListPlugins().Bind.Enabled
		p.handsOver = len(bind) > 0 && bind[0].Name == Name
		if !p.handsOver {
			klog.FromContext(ctx).Info("Tessera is not the profile's first bind plugin: the plugin server "+
				"writes each pod's annotations before DefaultBinder binds it (one more API write per pod); "+
				"see examples/scheduler-config.yaml", "plugin", Name, "bindPlugins", bind)
		}
	})
	return p.handsOver
}

// Bind binds a pod whose annotations PreBind handed over in one write: the Binding's metadata
// carries them, so the pod is never seen bound without its devices nor annotated while
// unbound. The UID precondition keeps a recreated namesake from being bound. Pods without
// handed-over annotations (no GPU, or the server wrote them) are DefaultBinder's.
func (p *Plugin) Bind(ctx context.Context, state fwk.CycleState, pod *v1.Pod, nodeName string) *fwk.Status {
	if hostOnlyDecision(state) {
		return fwk.NewStatus(fwk.Skip)
	}
	// PreBind has read Reserve's answer already; reading it here too keeps a handed-over pod
	// from going to DefaultBinder without its annotations, whatever ran before.
	if st := p.settleReserve(ctx, state, nodeName); !st.IsSuccess() {
		return st
	}
	data, err := state.Read(bindKey)
	if err != nil {
		return fwk.NewStatus(fwk.Skip)
	}
	h, ok := data.(*handedOver)
	if !ok {
		return fwk.AsStatus(fmt.Errorf("%s: CycleState %q holds %T, want *handedOver", Name, bindKey, data))
	}
	ctx, traced := p.tracing.startBind(ctx, state, pod, nodeName)
	binding := &v1.Binding{
		ObjectMeta: metav1.ObjectMeta{
			Namespace: pod.Namespace, Name: pod.Name, UID: pod.UID,
			Annotations: h.annotations, Labels: h.labels,
		},
		Target: v1.ObjectReference{Kind: "Node", Name: nodeName},
	}
	if err := p.handle.ClientSet().CoreV1().Pods(pod.Namespace).Bind(ctx, binding, metav1.CreateOptions{}); err != nil {
		// Unreserve follows and adds its span to the ended attempt.
		traced.end(OutcomeError, err)
		traced.finish(OutcomeError)
		return fwk.AsStatus(fmt.Errorf("tessera: binding pod %s/%s to node %s with its device annotations: %w",
			pod.Namespace, pod.Name, nodeName, err))
	}
	traced.end(OutcomeOK, nil)
	traced.finish(OutcomeBound)
	klog.FromContext(ctx).V(3).Info("Bound with device annotations", "plugin", Name, "pod", klog.KObj(pod), "node", nodeName)
	return nil
}
