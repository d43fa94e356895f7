package tessera

import (
	"reflect"

	v1 "k8s.io/api/core/v1"
	fwk "k8s.io/kube-scheduler/framework"
	"k8s.io/kubernetes/pkg/scheduler/framework"
	"k8s.io/kubernetes/pkg/scheduler/framework/plugins/names"
)

// fitStateKey is where NodeResourcesFit's PreFilter, which runs before Tessera's, keeps the
// pod's summed requests for its Filter.
const fitStateKey fwk.StateKey = "PreFilter" + names.NodeResourcesFit

// trimFitRequests removes the per-GPU memory and cores resources (Tessera's to account; the
// profile already tells NodeResourcesFit to ignore them) from NodeResourcesFit's copy of the
// pod's requests. Ignoring them still costs NodeResourcesFit.Filter an extended-resource-name
// check (a regexp) per resource per node: 18% of the scheduler's CPU at 1000 nodes, more at
// 5000. The count resource stays (nodes advertise it). The state is reached by reflection
// because its type is unexported; if its shape ever differs, nothing is changed and the
// ignoredResources config keeps the result the same. Reports whether it trimmed.
func trimFitRequests(state fwk.CycleState, drop []v1.ResourceName) bool {
	res := fitRequests(state)
	if res == nil {
		return false
	}
	for _, name := range drop {
		delete(res.ScalarResources, name)
	}
	return true
}

// fitRequests is NodeResourcesFit's copy of the pod's requests, or nil.
func fitRequests(state fwk.CycleState) *framework.Resource {
	data, err := state.Read(fitStateKey)
	if err != nil {
		return nil
	}
	v := reflect.ValueOf(data)
	if v.Kind() != reflect.Pointer || v.IsNil() || v.Elem().Kind() != reflect.Struct {
		return nil
	}
	f := v.Elem().FieldByName("Resource")
	if !f.IsValid() || f.Type() != reflect.TypeFor[framework.Resource]() || !f.CanAddr() {
		return nil
	}
	res, _ := f.Addr().Interface().(*framework.Resource)
	return res
}
