package tessera

import (
	v1 "k8s.io/api/core/v1"
)

// resourceNames are the extended resources that make a pod Tessera's, in a fixed order (count,
// memory, memory percentage, cores) that SignPod relies on.
type resourceNames [4]v1.ResourceName

// requested reports whether any container (init or regular) asks for a Tessera resource.
func (r resourceNames) requested(pod *v1.Pod) bool {
	for _, list := range [][]v1.Container{pod.Spec.InitContainers, pod.Spec.Containers} {
		for i := range list {
			res := &list[i].Resources
			for _, name := range r {
				if q, ok := res.Limits[name]; ok && !q.IsZero() {
					return true
				}
				if q, ok := res.Requests[name]; ok && !q.IsZero() {
					return true
				}
			}
		}
	}
	return false
}
