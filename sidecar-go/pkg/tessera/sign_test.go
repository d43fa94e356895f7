package tessera

import (
	"context"
	"encoding/json"
	"testing"

	v1 "k8s.io/api/core/v1"
)

func signature(t *testing.T, p *Plugin, pod *v1.Pod) string {
	t.Helper()
	frags, st := p.SignPod(context.Background(), pod)
	if !st.IsSuccess() {
		t.Fatalf("SignPod = %v", st)
	}
	b, err := json.Marshal(frags)
	if err != nil {
		t.Fatalf("fragments are not JSON-marshallable: %v", err)
	}
	return string(b)
}

func TestSignPodCoversExactlyWhatTheDecisionDependsOn(t *testing.T) {
	p := newTestPlugin(t, nil)
	base := func() *podBuilder {
		return makePod("a").gpu("1").mem("3000").annotate("hami.io/node-scheduler-policy", "binpack")
	}
	ref := signature(t, p, base().obj())

	same := map[string]*v1.Pod{
		"other name and labels": makePod("b").gpu("1").mem("3000").annotate("hami.io/node-scheduler-policy", "binpack").label("app", "x").obj(),
		"unrelated annotation":  base().annotate("team", "ml").obj(),
		"same quantity, other spelling": makePod("a").gpu("1").mem("3k").
			annotate("hami.io/node-scheduler-policy", "binpack").obj(),
	}
	for name, pod := range same {
		if got := signature(t, p, pod); got != ref {
			t.Errorf("%s: signature differs:\n%s\n%s", name, got, ref)
		}
	}

	different := map[string]*v1.Pod{
		"gpumem":             makePod("a").gpu("1").mem("4000").annotate("hami.io/node-scheduler-policy", "binpack").obj(),
		"gpu count":          makePod("a").gpu("2").mem("3000").annotate("hami.io/node-scheduler-policy", "binpack").obj(),
		"gpucores added":     base().limit(DefaultResourceCoreName, "30").obj(),
		"node policy":        makePod("a").gpu("1").mem("3000").annotate("hami.io/node-scheduler-policy", "spread").obj(),
		"gpu policy":         base().annotate("hami.io/gpu-scheduler-policy", "binpack").obj(),
		"vgpu mode":          base().annotate("nvidia.com/vgpu-mode", "mig").obj(),
		"use-gputype":        base().annotate("nvidia.com/use-gputype", "A100").obj(),
		"nouse-gputype":      base().annotate("nvidia.com/nouse-gputype", "T4").obj(),
		"use-gpuuuid":        base().annotate("nvidia.com/use-gpuuuid", "GPU-1").obj(),
		"nouse-gpuuuid":      base().annotate("nvidia.com/nouse-gpuuuid", "GPU-1").obj(),
		"numa-bind":          base().annotate("nvidia.com/numa-bind", "true").obj(),
		"scoring weights":    base().annotate("hami.io/device-scoring-weights", "slot=1,core=1,memory=3").obj(),
		"init container gpu": base().initLimit(DefaultResourceCountName, "1").obj(),
		"request without limit": func() *v1.Pod {
			pod := base().obj()
			pod.Spec.Containers[0].Resources.Requests[DefaultResourceMemoryPercentageName] = pod.Spec.Containers[0].Resources.Limits[DefaultResourceMemoryName]
			return pod
		}(),
	}
	for name, pod := range different {
		if got := signature(t, p, pod); got == ref {
			t.Errorf("%s: signature unchanged, batching would reuse a decision that no longer applies", name)
		}
	}
}
