package tessera

import (
	"context"

	v1 "k8s.io/api/core/v1"
	fwk "k8s.io/kube-scheduler/framework"
)

// Signature fragment keys, named after the pod fields they read (framework/signers.go convention).
const (
	resourcesSignerName   = "v1.Pod.Spec.Containers.TesseraResources()"
	annotationsSignerName = "v1.Pod.Annotations.TesseraPolicy()"
)

// policyAnnotations are the user annotations the server's decision depends on: the plugin
// server's DECISION_ANNOTATIONS (api/hami/keys.py), which a unit test holds this list to.
var policyAnnotations = []string{
	"nvidia.com/vgpu-mode",
	"hami.io/node-scheduler-policy",
	"hami.io/gpu-scheduler-policy",
	"nvidia.com/use-gputype",
	"nvidia.com/nouse-gputype",
	"nvidia.com/use-gpuuuid",
	"nvidia.com/nouse-gpuuuid",
	"nvidia.com/numa-bind",
	"hami.io/device-scoring-weights",
}

// containerSign is one container's Tessera limits and requests, in resourceNames order; -1 means
// absent, so "absent" and "0" sign differently only if the server could tell them apart.
type containerSign struct {
	Limits   [4]int64 `json:"l"`
	Requests [4]int64 `json:"r"`
}

// SignPod signs exactly what the server's decision depends on (Tessera resources per container,
// init containers first, and the policy annotations), so pods that differ only elsewhere share a
// signature and kube-scheduler's opportunistic batching stays on.
func (p *Plugin) SignPod(_ context.Context, pod *v1.Pod) ([]fwk.SignFragment, *fwk.Status) {
	containers := make([]containerSign, 0, len(pod.Spec.InitContainers)+len(pod.Spec.Containers))
	for _, list := range [][]v1.Container{pod.Spec.InitContainers, pod.Spec.Containers} {
		for i := range list {
			containers = append(containers, p.resources.sign(&list[i].Resources))
		}
	}
	annotations := make([]string, len(policyAnnotations))
	for i, key := range policyAnnotations {
		annotations[i] = pod.Annotations[key]
	}
	return []fwk.SignFragment{
		{Key: resourcesSignerName, Value: containers},
		{Key: annotationsSignerName, Value: annotations},
	}, nil
}

func (r resourceNames) sign(res *v1.ResourceRequirements) containerSign {
	var s containerSign
	for i, name := range r {
		s.Limits[i], s.Requests[i] = -1, -1
		if q, ok := res.Limits[name]; ok {
			s.Limits[i] = q.Value()
		}
		if q, ok := res.Requests[name]; ok {
			s.Requests[i] = q.Value()
		}
	}
	return s
}
