package tessera

import (
	"context"
	"testing"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	fwk "k8s.io/kube-scheduler/framework"
	"k8s.io/kubernetes/pkg/scheduler/apis/config"
	"k8s.io/kubernetes/pkg/scheduler/framework"
	"k8s.io/kubernetes/pkg/scheduler/framework/plugins/feature"
	"k8s.io/kubernetes/pkg/scheduler/framework/plugins/noderesources"
)

// realFit is upstream NodeResourcesFit configured as examples/scheduler-config.yaml does.
func realFit(t *testing.T) fwk.FilterPlugin {
	t.Helper()
	pl, err := noderesources.NewFit(context.Background(), &config.NodeResourcesFitArgs{
		IgnoredResources: []string{DefaultResourceMemoryName, DefaultResourceMemoryPercentageName, DefaultResourceCoreName},
		ScoringStrategy: &config.ScoringStrategy{
			Type:      config.LeastAllocated,
			Resources: []config.ResourceSpec{{Name: "cpu", Weight: 1}, {Name: "memory", Weight: 1}},
		},
	}, nil, feature.Features{EnableSidecarContainers: true})
	if err != nil {
		t.Fatalf("NewFit: %v", err)
	}
	return pl.(fwk.FilterPlugin)
}

func gpuNode(name string, gpus int64) fwk.NodeInfo {
	ni := framework.NewNodeInfo()
	ni.SetNode(&v1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}, Status: v1.NodeStatus{Allocatable: v1.ResourceList{
		v1.ResourceCPU: resource.MustParse("8"), v1.ResourceMemory: resource.MustParse("32Gi"),
		v1.ResourcePods: resource.MustParse("110"), DefaultResourceCountName: *resource.NewQuantity(gpus, resource.DecimalSI),
	}}})
	return ni
}

func TestTrimFitRequestsLeavesNodeResourcesFitOnlyTheCount(t *testing.T) {
	fit := realFit(t)
	pod := makePod("p").gpu("2").mem("4000").limit(DefaultResourceCoreName, "30").obj()
	// As the API defaults them: extended resources' requests equal their limits.
	reqs := pod.Spec.Containers[0].Resources.Limits.DeepCopy()
	reqs[v1.ResourceCPU] = resource.MustParse("1")
	pod.Spec.Containers[0].Resources.Requests = reqs
	state := newState()
	if _, st := fit.(fwk.PreFilterPlugin).PreFilter(context.Background(), state, pod, nil); !st.IsSuccess() {
		t.Fatalf("NodeResourcesFit PreFilter = %v", st)
	}
	drop := []v1.ResourceName{DefaultResourceMemoryName, DefaultResourceMemoryPercentageName, DefaultResourceCoreName}
	if !trimFitRequests(state, drop) {
		t.Fatal("trimFitRequests found no NodeResourcesFit state to trim (its shape changed upstream?)")
	}
	got := fitRequests(state)
	if len(got.ScalarResources) != 1 || got.ScalarResources[DefaultResourceCountName] != 2 || got.MilliCPU != 1000 {
		t.Errorf("NodeResourcesFit's requests after trimming = cpu %dm, %v; want cpu 1000m and only %s: 2",
			got.MilliCPU, got.ScalarResources, DefaultResourceCountName)
	}
	// What NodeResourcesFit decides is unchanged: the GPU count and cpu still count.
	if st := fit.Filter(context.Background(), state, pod, gpuNode("fits", 2)); !st.IsSuccess() {
		t.Errorf("Filter on a node with 2 GPU slots = %v, want Success", st)
	}
	if st := fit.Filter(context.Background(), state, pod, gpuNode("short", 1)); st.IsSuccess() ||
		st.Message() != "Insufficient "+DefaultResourceCountName {
		t.Errorf("Filter on a node with 1 GPU slot = %v, want Insufficient %s", st, DefaultResourceCountName)
	}
}

func TestTrimFitRequestsWithoutNodeResourcesFitChangesNothing(t *testing.T) {
	if trimFitRequests(newState(), []v1.ResourceName{DefaultResourceMemoryName}) {
		t.Error("trimmed without NodeResourcesFit's state")
	}
}

func TestPreFilterTrimsNodeResourcesFitRequestsOfATesseraPod(t *testing.T) {
	fake_, p := startFake(t, nil)
	fake_.set(func(s *fakeServer) { s.preFilter = okResponse() })
	pod := makePod("p").gpu("1").mem("2000").obj()
	pod.Spec.Containers[0].Resources.Requests = pod.Spec.Containers[0].Resources.Limits.DeepCopy()
	state := newState()
	if _, st := realFit(t).(fwk.PreFilterPlugin).PreFilter(context.Background(), state, pod, nil); !st.IsSuccess() {
		t.Fatalf("NodeResourcesFit PreFilter = %v", st)
	}
	if _, st := p.PreFilter(context.Background(), state, pod, nil); !st.IsSuccess() {
		t.Fatalf("Tessera PreFilter = %v", st)
	}
	if got := fitRequests(state).ScalarResources; len(got) != 1 {
		t.Errorf("NodeResourcesFit's scalar requests after Tessera's PreFilter = %v, want only the count", got)
	}
}
