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
	cases := []struct {
		name     string
		old, new *v1.Pod
		want     fwk.QueueingHint
	}{
		{"GPU pod deleted", makePod("gpu").gpu("1").obj(), nil, fwk.Queue},
		{"CPU pod deleted", makePod("cpu").obj(), nil, fwk.QueueSkip},
		{"bound GPU pod updated", boundTo(makePod("gpu").gpu("1").obj(), "n1"), boundTo(makePod("gpu").gpu("1").annotate("hami.io/bind-phase", "success").obj(), "n1"), fwk.Queue},
		{"GPU pod bound", makePod("gpu").gpu("1").obj(), boundTo(makePod("gpu").gpu("1").obj(), "n1"), fwk.Queue},
		// kube-scheduler writing why another pending GPU pod (a gang member) waits.
		{"pending GPU pod's status updated", makePod("gpu").gpu("1").obj(), makePod("gpu").gpu("1").annotate("x", "y").obj(), fwk.QueueSkip},
		{"own policy changed", pending, withMode, fwk.Queue},
		{"own label changed", pending, makePod("pending").gpu("1").label("a", "b").obj(), fwk.QueueSkip},
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
			got, err := pod.QueueingHintFn(klog.Background(), pending, oldObj, newObj)
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
