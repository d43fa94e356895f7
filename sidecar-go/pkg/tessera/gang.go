package tessera

import (
	"fmt"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	utilfeature "k8s.io/apiserver/pkg/util/feature"
	"k8s.io/client-go/discovery"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/pkg/features"
)

// podGroupAPI serves kube-scheduler 1.36's PodGroups (alpha), the gangs Tessera schedules.
const podGroupAPI = "scheduling.k8s.io/v1alpha2"

// checkGangAPI refuses to start a scheduler whose GenericWorkload gate is on against an API
// server that does not serve PodGroups: kube-scheduler would wait for their first list before
// scheduling anything, for ever, with only a list error in its log. An API server it cannot
// reach now is left to kube-scheduler's own retries.
func checkGangAPI(d discovery.DiscoveryInterface) error {
	if d == nil || !utilfeature.DefaultFeatureGate.Enabled(features.GenericWorkload) {
		return nil
	}
	if utilfeature.DefaultFeatureGate.Enabled(features.SchedulerPopFromBackoffQ) {
		klog.InfoS("Feature gate SchedulerPopFromBackoffQ is on: an idle scheduler retries a gang that does not fit "+
			"at once, again and again (tessera-scheduler turns it off unless told otherwise)", "plugin", Name)
	}
	_, err := d.ServerResourcesForGroupVersion(podGroupAPI)
	switch {
	case err == nil:
		return nil
	case apierrors.IsNotFound(err):
		return fmt.Errorf("feature gate %s is on but the API server does not serve %s PodGroups: "+
			"start kube-apiserver with --feature-gates=%s=true,%s=true and --runtime-config=%s=true, "+
			"or turn gangs off (remove %s from tessera-scheduler's --feature-gates)",
			features.GenericWorkload, podGroupAPI, features.GenericWorkload, features.GangScheduling,
			podGroupAPI, features.GenericWorkload)
	default:
		klog.InfoS("Cannot check that the API server serves PodGroups; going on", "plugin", Name, "err", err)
		return nil
	}
}
