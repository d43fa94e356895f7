package tessera

import (
	"context"
	"slices"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/events"
	"k8s.io/klog/v2/ktesting"
	fwk "k8s.io/kube-scheduler/framework"
	"k8s.io/kubernetes/pkg/scheduler/apis/config"
	internalcache "k8s.io/kubernetes/pkg/scheduler/backend/cache"
	internalqueue "k8s.io/kubernetes/pkg/scheduler/backend/queue"
	"k8s.io/kubernetes/pkg/scheduler/framework"
	"k8s.io/kubernetes/pkg/scheduler/framework/plugins/defaultbinder"
	"k8s.io/kubernetes/pkg/scheduler/framework/plugins/defaultpreemption"
	"k8s.io/kubernetes/pkg/scheduler/framework/plugins/feature"
	"k8s.io/kubernetes/pkg/scheduler/framework/plugins/queuesort"
	frameworkruntime "k8s.io/kubernetes/pkg/scheduler/framework/runtime"
	"k8s.io/kubernetes/pkg/scheduler/metrics"
	tf "k8s.io/kubernetes/pkg/scheduler/testing/framework"

	"tessera/sidecar-go/pkg/pluginv1"
)

// TestDefaultPreemptionEvictsTheFewestGPUPodsTesseraNeedsGone runs kube-scheduler's own
// framework and DefaultPreemption (PostFilter after Tessera, as the example profile orders them)
// against the fake server. n2 is preemptible: the pod fits there once one of its two
// lower-priority GPU pods is gone. DefaultPreemption removes every lower-priority pod, asks,
// then adds them back most important first: low-a and the CPU pod come back, low-b is the victim.
func TestDefaultPreemptionEvictsTheFewestGPUPodsTesseraNeedsGone(t *testing.T) {
	metrics.Register() // the scheduling queue records into them; registered once per process
	start := metav1.NewTime(time.Now().Add(-time.Hour))
	on := func(b *podBuilder, node string, started time.Duration) *v1.Pod {
		pod := b.obj()
		pod.Spec.NodeName = node
		t := metav1.NewTime(start.Add(started))
		pod.Status.StartTime = &t
		return pod
	}
	// Older pods are more important at equal priority: low-a is added back first.
	pods := []*v1.Pod{
		on(makePod("low-a").gpu("1").priority(0), "n2", 0),
		on(makePod("low-cpu").priority(0), "n2", time.Minute),
		on(makePod("low-b").gpu("1").priority(0), "n2", 2*time.Minute),
		on(makePod("high").gpu("1").priority(1000), "n2", 0),
		on(makePod("low-c").gpu("1").priority(0), "n1", 0), // n1 is no use even without it
	}
	var nodes []*v1.Node
	for _, n := range []string{"n1", "n2", "n3"} {
		nodes = append(nodes, &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: n}, Status: v1.NodeStatus{Allocatable: v1.ResourceList{
			v1.ResourceCPU: resource.MustParse("8"), v1.ResourcePods: resource.MustParse("110"),
		}}})
	}
	preemptor := makePod("hi").gpu("1").priority(100).obj()
	preemptor.Spec.SchedulerName = "hami-scheduler"

	fake_, p := startFake(t, nil)
	fake_.set(func(s *fakeServer) {
		s.preFilter = unschedulablePreemptible()
		// n2 has room for the pod once any one of its GPU pods is gone.
		s.whatIf = func(req *pluginv1.FilterWhatIfRequest) *pluginv1.FilterWhatIfResponse {
			if req.GetNode() == "n2" && len(req.GetRemovedPodUids()) > 0 && len(req.GetAddedPodsJson()) == 0 {
				return &pluginv1.FilterWhatIfResponse{Fits: true}
			}
			return &pluginv1.FilterWhatIfResponse{Message: "GPU 0 and 1 taken"}
		}
	})

	objects := []runtime.Object{preemptor}
	for _, pod := range pods {
		objects = append(objects, pod)
	}
	cs := fake.NewClientset(objects...)
	var deleted []string
	cs.PrependReactor("delete", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
		deleted = append(deleted, a.(k8stesting.DeleteAction).GetName())
		return false, nil, nil
	})
	informerFactory := informers.NewSharedInformerFactory(cs, 0)
	podStore := informerFactory.Core().V1().Pods().Informer().GetStore()
	for _, o := range objects {
		if err := podStore.Add(o); err != nil {
			t.Fatal(err)
		}
	}
	logger, ctx := ktesting.NewTestContext(t)
	tessera := func(_ context.Context, _ runtime.Object, h fwk.Handle) (fwk.Plugin, error) {
		p.handle = h
		return p, nil
	}
	preemption := func(ctx context.Context, _ runtime.Object, h fwk.Handle) (fwk.Plugin, error) {
		return defaultpreemption.New(ctx, &config.DefaultPreemptionArgs{MinCandidateNodesPercentage: 10, MinCandidateNodesAbsolute: 100}, h, feature.Features{})
	}
	f, err := tf.NewFramework(ctx, []tf.RegisterPluginFunc{
		tf.RegisterQueueSortPlugin(queuesort.Name, queuesort.New),
		tf.RegisterPluginAsExtensions(Name, tessera, "PreFilter", "Filter", "PostFilter"),
		tf.RegisterPostFilterPlugin(defaultpreemption.Name, preemption),
		tf.RegisterBindPlugin(defaultbinder.Name, defaultbinder.New),
	}, "hami-scheduler",
		frameworkruntime.WithClientSet(cs),
		frameworkruntime.WithEventRecorder(&events.FakeRecorder{}),
		frameworkruntime.WithInformerFactory(informerFactory),
		frameworkruntime.WithPodNominator(internalqueue.NewSchedulingQueue(nil, informerFactory)),
		frameworkruntime.WithSnapshotSharedLister(internalcache.NewSnapshot(pods, nodes)),
		frameworkruntime.WithLogger(logger),
		frameworkruntime.WithWaitingPods(frameworkruntime.NewWaitingPodsMap()),
		frameworkruntime.WithPodsInPreBind(frameworkruntime.NewPodsInPreBindMap()),
	)
	if err != nil {
		t.Fatalf("NewFramework: %v", err)
	}

	// The failed scheduling cycle: PreFilter succeeds (no node fits now, one is preemptible)
	// and Filter gives each node its status.
	state := framework.NewCycleState()
	if res, st, _ := f.RunPreFilterPlugins(ctx, state, preemptor); !st.IsSuccess() || !res.AllNodes() {
		t.Fatalf("RunPreFilterPlugins = %v, %v; want Success filtering every node", res, st)
	}
	statuses := framework.NewDefaultNodeToStatus()
	for _, n := range []string{"n1", "n2", "n3"} {
		ni, err := f.SnapshotSharedLister().NodeInfos().Get(n)
		if err != nil {
			t.Fatal(err)
		}
		st := f.RunFilterPluginsWithNominatedPods(ctx, state, preemptor, ni)
		want := fwk.UnschedulableAndUnresolvable
		if n == "n2" {
			want = fwk.Unschedulable
		}
		if st.Code() != want {
			t.Errorf("Filter(%s) = %v, want %v", n, st, want)
		}
		statuses.Set(n, st)
	}

	res, st := f.RunPostFilterPlugins(ctx, state, preemptor, statuses)
	if !st.IsSuccess() || res == nil || res.NominatedNodeName != "n2" {
		t.Fatalf("RunPostFilterPlugins = %+v, %v; want DefaultPreemption to nominate n2", res, st)
	}
	if !slices.Equal(deleted, []string{"low-b"}) {
		t.Errorf("deleted pods %v, want only the victim low-b", deleted)
	}

	// What Tessera asked: first with every lower-priority GPU pod gone (the CPU pod changes
	// nothing on GPUs), then with low-a back; low-cpu's return changed nothing (answered from
	// memory) and low-b's return left nothing removed (no call).
	var asked [][]string
	for _, req := range fake_.askedWhatIfs() {
		asked = append(asked, req.GetRemovedPodUids())
		if req.GetNode() != "n2" || req.GetDecisionId() != 7 || len(req.GetAddedPodsJson()) != 0 {
			t.Errorf("FilterWhatIf request = %v", req)
		}
	}
	want := [][]string{{"uid-low-a", "uid-low-b"}, {"uid-low-b"}}
	if !slices.EqualFunc(asked, want, slices.Equal[[]string]) {
		t.Errorf("FilterWhatIf removed_pod_uids = %v, want %v", asked, want)
	}
	if n := fake_.count("Explain"); n != 0 {
		t.Errorf("Explain calls = %d, want 0 (PreFilter explained)", n)
	}
}
