package tessera

import (
	"context"
	"time"

	v1 "k8s.io/api/core/v1"
	resourcehelper "k8s.io/component-helpers/resource"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"
)

// EventsToRegister lists what can make a pod this plugin rejected fit: a node added or its GPU
// registration annotation changed, and a GPU pod deleted or changed (finished, or its allocation
// annotations rewritten by the node agent).
func (p *Plugin) EventsToRegister(_ context.Context) ([]fwk.ClusterEventWithHint, error) {
	return []fwk.ClusterEventWithHint{
		{Event: fwk.ClusterEvent{Resource: fwk.Node, ActionType: fwk.Add | fwk.UpdateNodeAnnotation | fwk.UpdateNodeAllocatable}, QueueingHintFn: p.nodeChanged},
		{Event: fwk.ClusterEvent{Resource: fwk.Pod, ActionType: fwk.Delete | fwk.Update}, QueueingHintFn: p.isGPUPodChange},
	}, nil
}

// isGPUPodChange requeues for changes to other pods that hold Tessera resources (bound, or
// deleted), for a bound pod that frees CPU or memory of a kind the rejected pod asks for (gone:
// deleted, or finished, which kube-scheduler reports as a delete; or resized down in place:
// Tessera counts a GPU node's CPU and memory with its GPUs, so it may have rejected the pod
// for those), and for the rejected pod's own policy annotations changing (its container
// requests are immutable).
func (p *Plugin) isGPUPodChange(_ klog.Logger, pod *v1.Pod, oldObj, newObj interface{}) (fwk.QueueingHint, error) {
	oldPod, _ := oldObj.(*v1.Pod)
	newPod, _ := newObj.(*v1.Pod)
	for _, other := range []*v1.Pod{newPod, oldPod} {
		if other == nil {
			continue
		}
		if other.UID == pod.UID {
			if oldPod != nil && newPod != nil && policyChanged(oldPod, newPod) {
				return fwk.Queue, nil
			}
			return fwk.QueueSkip, nil
		}
		if oldPod != nil && newPod != nil && oldPod.Spec.NodeName == "" && newPod.Spec.NodeName == "" {
			// A pending pod's update (kube-scheduler writing why it waits, as it does for
			// every member of a gang after each attempt) frees and takes no GPU.
			return fwk.QueueSkip, nil
		}
		if p.resources.requested(other) || (oldPod != nil && freesHostFor(pod, oldPod, newPod)) {
			p.events.seen(time.Now()) // the server's watch may apply it after the next cycle
			return fwk.Queue, nil
		}
	}
	return fwk.QueueSkip, nil
}

// freesHostFor reports whether a bound pod, before a change and after it (nil: gone), freed
// CPU or memory that pod asks for: it held some and is gone, or its requests of it shrank
// (requests as kube-scheduler counts them).
func freesHostFor(pod, before, after *v1.Pod) bool {
	if before.Spec.NodeName == "" {
		return false
	}
	want := resourcehelper.PodRequests(pod, resourcehelper.PodResourcesOptions{})
	held := resourcehelper.PodRequests(before, resourcehelper.PodResourcesOptions{})
	var kept v1.ResourceList
	if after != nil {
		kept = resourcehelper.PodRequests(after, resourcehelper.PodResourcesOptions{})
	}
	for _, name := range []v1.ResourceName{v1.ResourceCPU, v1.ResourceMemory} {
		w, h := want[name], held[name]
		if w.IsZero() || h.IsZero() {
			continue
		}
		if k := kept[name]; after == nil || k.Cmp(h) < 0 {
			return true
		}
	}
	return false
}

func policyChanged(oldPod, newPod *v1.Pod) bool {
	for _, key := range policyAnnotations {
		if oldPod.Annotations[key] != newPod.Annotations[key] {
			return true
		}
	}
	return false
}
