package tessera

import (
	"context"
	"os"
	"slices"
	"testing"

	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/tools/events"
	"k8s.io/klog/v2/ktesting"
	"k8s.io/kubernetes/pkg/scheduler"
	"k8s.io/kubernetes/pkg/scheduler/apis/config"
	"k8s.io/kubernetes/pkg/scheduler/apis/config/scheme"
	"k8s.io/kubernetes/pkg/scheduler/framework/plugins/names"
	frameworkruntime "k8s.io/kubernetes/pkg/scheduler/framework/runtime"
	"k8s.io/kubernetes/pkg/scheduler/profile"
)

// TestExampleProfileOrdersTesseraBeforeTheDefaults loads examples/scheduler-config.yaml as
// kube-scheduler does (decoding, v1 defaults, MultiPoint expansion) and checks the orders the
// plugin relies on: its PostFilter before DefaultPreemption (which would otherwise evict pods
// for a pod about to be retried with every feasible node, and whose success would skip the
// explanation), and its Bind before DefaultBinder (the hand-over).
func TestExampleProfileOrdersTesseraBeforeTheDefaults(t *testing.T) {
	raw, err := os.ReadFile("../../../examples/scheduler-config.yaml")
	if err != nil {
		t.Fatal(err)
	}
	obj, _, err := scheme.Codecs.UniversalDecoder().Decode(raw, nil, nil)
	if err != nil {
		t.Fatalf("decoding the example profile: %v", err)
	}
	cfg, ok := obj.(*config.KubeSchedulerConfiguration)
	if !ok {
		t.Fatalf("decoded %T", obj)
	}
	client := fake.NewClientset()
	_, ctx := ktesting.NewTestContext(t)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	s, err := scheduler.New(ctx, client, informers.NewSharedInformerFactory(client, 0), nil,
		profile.NewRecorderFactory(events.NewBroadcaster(&events.EventSinkImpl{Interface: client.EventsV1()})),
		scheduler.WithProfiles(cfg.Profiles...),
		scheduler.WithFrameworkOutOfTreeRegistry(frameworkruntime.Registry{Name: New}),
	)
	if err != nil {
		t.Fatalf("building the example profile: %v", err)
	}
	fw, ok := s.Profiles["hami-scheduler"]
	if !ok {
		t.Fatalf("no hami-scheduler profile in %v", s.Profiles)
	}
	plugins := fw.ListPlugins()
	order := func(set config.PluginSet) []string {
		var got []string
		for _, p := range set.Enabled {
			got = append(got, p.Name)
		}
		return got
	}
	postFilter, bind := order(plugins.PostFilter), order(plugins.Bind)
	self, preemption := slices.Index(postFilter, Name), slices.Index(postFilter, names.DefaultPreemption)
	if self < 0 || preemption < self {
		t.Errorf("postFilter plugins %v: want %s, then %s", postFilter, Name, names.DefaultPreemption)
	}
	if !slices.Equal(bind, []string{Name, names.DefaultBinder}) {
		t.Errorf("bind plugins %v, want [%s %s]", bind, Name, names.DefaultBinder)
	}
	for _, point := range []config.PluginSet{plugins.PreFilter, plugins.Filter} {
		if !slices.Contains(order(point), Name) {
			t.Errorf("%s missing from %v", Name, order(point))
		}
	}
	for _, closer := range s.Profiles {
		_ = closer.Close()
	}
}
