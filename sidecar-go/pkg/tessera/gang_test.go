package tessera

import (
	"context"
	fwk "k8s.io/kube-scheduler/framework"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	utilfeature "k8s.io/apiserver/pkg/util/feature"
	fakediscovery "k8s.io/client-go/discovery/fake"
	k8stesting "k8s.io/client-go/testing"
	featuregatetesting "k8s.io/component-base/featuregate/testing"
	"k8s.io/kubernetes/pkg/features"
	"k8s.io/kubernetes/pkg/scheduler/framework"
)

func gangMember(name string) *v1.Pod {
	pod := makePod(name).gpu("2").obj()
	pod.Spec.SchedulingGroup = &v1.PodSchedulingGroup{PodGroupName: ptr("train")}
	return pod
}

// A gang's trial cycle: Reserve counts the member but hands nothing over (the cycle reverts
// it); its Unreserve is the trial's revert, not a release of an admitted gang.
func TestGangTrialReserveIsNeverHandedOver(t *testing.T) {
	fake, p := startFake(t, nil)
	fake.set(func(s *fakeServer) { s.reserveHandsOver = true })
	p.bindOrder.Do(func() { p.handsOver = true })
	pod := gangMember("m0")
	state := decided(t, fake, p).(*framework.CycleState)
	state.SetPodGroupSchedulingCycle(framework.NewCycleState())

	if st := p.Reserve(context.Background(), state, pod, "n1"); !st.IsSuccess() {
		t.Fatalf("trial Reserve = %v", st)
	}
	if _, r, _, _ := fake.last(); !r.GetTrial() || r.GetHandOver() {
		t.Errorf("trial ReserveRequest = %v, want trial and no hand-over", r)
	}
	if _, err := state.Read(bindKey); err == nil {
		t.Error("a trial Reserve left annotations for Bind")
	}
	p.Unreserve(context.Background(), state, pod, "n1")
	if _, _, u, _ := fake.last(); u.GetGangReleased() {
		t.Errorf("trial revert sent as a gang release: %v", u)
	}

	// The gang fits: kube-scheduler reserves the member again in the same state, outside the trial.
	state.SetPodGroupSchedulingCycle(nil)
	if st := p.Reserve(context.Background(), state, pod, "n1"); !st.IsSuccess() {
		t.Fatalf("Reserve = %v", st)
	}
	if _, st := p.PreBindPreFlight(context.Background(), state, pod, "n1"); st.Code() != fwk.Skip {
		t.Errorf("admitted member's PreBindPreFlight = %v, want Skip (handed over at Reserve)", st)
	}
	if _, r, _, _ := fake.last(); r.GetTrial() || !r.GetHandOver() {
		t.Errorf("admitted member's ReserveRequest = %v, want hand-over", r)
	}
	if _, err := state.Read(bindKey); err != nil {
		t.Errorf("handed-over annotations missing: %v", err)
	}
	// Its Permit wait runs out: Unreserve releases it, and Bind must not find stale annotations.
	p.Unreserve(context.Background(), state, pod, "n1")
	if _, _, u, _ := fake.last(); !u.GetGangReleased() {
		t.Errorf("admitted member's Unreserve = %v, want gang_released", u)
	}
	if _, err := state.Read(bindKey); err == nil {
		t.Error("Unreserve left handed-over annotations in the cycle state")
	}
}

func TestUnreserveOfAPodWithoutGangIsNoRelease(t *testing.T) {
	fake, p := startFake(t, nil)
	state := decided(t, fake, p)
	p.Unreserve(context.Background(), state, makePod("solo").gpu("1").obj(), "n1")
	if _, _, u, _ := fake.last(); u.GetGangReleased() {
		t.Errorf("UnreserveRequest = %v, want no gang release", u)
	}
}

func TestCheckGangAPI(t *testing.T) {
	served := func() *fakediscovery.FakeDiscovery {
		d := &fakediscovery.FakeDiscovery{Fake: &k8stesting.Fake{}}
		d.Resources = []*metav1.APIResourceList{{GroupVersion: podGroupAPI, APIResources: []metav1.APIResource{{Name: "podgroups"}}}}
		return d
	}
	notServed := &fakediscovery.FakeDiscovery{Fake: &k8stesting.Fake{}}

	cases := []struct {
		name    string
		gate    bool
		d       *fakediscovery.FakeDiscovery
		wantErr string
	}{
		{"gangs off", false, notServed, ""},
		{"gangs on, API served", true, served(), ""},
		{"gangs on, API not served", true, notServed, "does not serve scheduling.k8s.io/v1alpha2 PodGroups"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			featuregatetesting.SetFeatureGateDuringTest(t, utilfeature.DefaultFeatureGate, features.GenericWorkload, tc.gate)
			err := checkGangAPI(tc.d)
			if tc.wantErr == "" && err != nil || tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)) {
				t.Errorf("checkGangAPI = %v, want error containing %q", err, tc.wantErr)
			}
		})
	}
}
