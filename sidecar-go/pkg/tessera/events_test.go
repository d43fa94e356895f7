package tessera

import (
	"context"
	"testing"

	v1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"
)

func TestEventsToRegisterCoverNodesAndGPUPods(t *testing.T) {
	p := newTestPlugin(t, nil)
	events, err := p.EventsToRegister(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	var node, pod *fwk.ClusterEventWithHint
	for i := range events {
		switch events[i].Event.Resource {
		case fwk.Node:
			node = &events[i]
		case fwk.Pod:
			pod = &events[i]
		}
	}
	if node == nil || node.Event.ActionType&fwk.Add == 0 || node.Event.ActionType&fwk.UpdateNodeAnnotation == 0 {
		t.Fatalf("node event = %+v, want Add|UpdateNodeAnnotation", node)
	}
	if pod == nil || pod.Event.ActionType&fwk.Delete == 0 || pod.Event.ActionType&fwk.Update == 0 || pod.QueueingHintFn == nil {
		t.Fatalf("pod event = %+v, want Delete|Update with a hint", pod)
	}

	pending := makePod("pending").gpu("1").obj()
	withMode := makePod("pending").gpu("1").annotate("nvidia.com/vgpu-mode", "mig").obj()
	noHost := makePod("pending").gpu("1").host(nil).obj()
	memOnly := map[v1.ResourceName]string{v1.ResourceMemory: "1Gi"}
	twoCPUs := map[v1.ResourceName]string{v1.ResourceCPU: "2"}
	cpuAndMem := map[v1.ResourceName]string{v1.ResourceCPU: "1", v1.ResourceMemory: "1Gi"}
	cases := []struct {
		name     string
		pending  *v1.Pod // nil: pending
		old, new *v1.Pod
		want     fwk.QueueingHint
	}{
		{"GPU pod deleted", nil, makePod("gpu").gpu("1").obj(), nil, fwk.Queue},
		{"unbound CPU pod deleted", nil, makePod("cpu").obj(), nil, fwk.QueueSkip},
		// Tessera counts a GPU node's CPU and memory: the pending pod may have lacked them.
		{"bound CPU pod deleted", nil, boundTo(makePod("cpu").obj(), "n1"), nil, fwk.Queue},
		{"bound CPU pod deleted, pending asks no CPU or memory", noHost, boundTo(makePod("cpu").obj(), "n1"), nil, fwk.QueueSkip},
		{"bound memory-only pod deleted, pending asks CPU", nil, boundTo(makePod("mem").host(memOnly).obj(), "n1"), nil, fwk.QueueSkip},
		{"bound memory-only pod deleted, pending asks memory", makePod("pending").gpu("1").host(memOnly).obj(), boundTo(makePod("mem").host(memOnly).obj(), "n1"), nil, fwk.Queue},
		{"bound CPU pod resized down", nil, boundTo(makePod("cpu").host(twoCPUs).obj(), "n1"), boundTo(makePod("cpu").obj(), "n1"), fwk.Queue},
		{"bound CPU pod resized up", nil, boundTo(makePod("cpu").obj(), "n1"), boundTo(makePod("cpu").host(twoCPUs).obj(), "n1"), fwk.QueueSkip},
		{"bound CPU pod's memory resized down, pending asks CPU", nil, boundTo(makePod("cpu").host(cpuAndMem).obj(), "n1"), boundTo(makePod("cpu").obj(), "n1"), fwk.QueueSkip},
		{"bound CPU pod updated", nil, boundTo(makePod("cpu").obj(), "n1"), boundTo(makePod("cpu").label("a", "b").obj(), "n1"), fwk.QueueSkip},
		{"bound GPU pod updated", nil, boundTo(makePod("gpu").gpu("1").obj(), "n1"), boundTo(makePod("gpu").gpu("1").annotate("hami.io/bind-phase", "success").obj(), "n1"), fwk.Queue},
		{"GPU pod bound", nil, makePod("gpu").gpu("1").obj(), boundTo(makePod("gpu").gpu("1").obj(), "n1"), fwk.Queue},
		// kube-scheduler writing why another pending GPU pod (a gang member) waits.
		{"pending GPU pod's status updated", nil, makePod("gpu").gpu("1").obj(), makePod("gpu").gpu("1").annotate("x", "y").obj(), fwk.QueueSkip},
		{"own policy changed", nil, pending, withMode, fwk.Queue},
		{"own numa-bind changed", nil, pending, makePod("pending").gpu("1").annotate("nvidia.com/numa-bind", "false").obj(), fwk.Queue},
		{"own scoring weights changed", nil, pending, makePod("pending").gpu("1").annotate("hami.io/device-scoring-weights", "slot=1,core=1,memory=3").obj(), fwk.Queue},
		{"own label changed", nil, pending, makePod("pending").gpu("1").label("a", "b").obj(), fwk.QueueSkip},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var oldObj, newObj interface{}
			if tc.old != nil {
				oldObj = tc.old
			}
			if tc.new != nil {
				newObj = tc.new
			}
			waiting := pending
			if tc.pending != nil {
				waiting = tc.pending
			}
			got, err := pod.QueueingHintFn(klog.Background(), waiting, oldObj, newObj)
			if err != nil || got != tc.want {
				t.Errorf("hint = %v, %v; want %v", got, err, tc.want)
			}
		})
	}
}

func boundTo(pod *v1.Pod, node string) *v1.Pod {
	pod.Spec.NodeName = node
	return pod
}
