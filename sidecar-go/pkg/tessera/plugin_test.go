package tessera

import (
	"context"
	"reflect"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
)

func metav1Duration(d time.Duration) metav1.Duration { return metav1.Duration{Duration: d} }

func ptr[T any](v T) *T { return &v }

func TestNewDecodesAndDefaultsArgs(t *testing.T) {
	cases := []struct {
		name string
		obj  runtime.Object
		want Args
	}{
		{"nil means defaults", nil, Args{}},
		{"empty unknown", &runtime.Unknown{}, Args{}},
		{"json", &runtime.Unknown{Raw: []byte(`{"socket":"/tmp/t.sock","timeout":"500ms","resourceCountName":"example.com/vgpu"}`)},
			Args{Socket: "/tmp/t.sock", Timeout: metav1Duration(500 * time.Millisecond), ResourceCountName: "example.com/vgpu"}},
		{"yaml", &runtime.Unknown{Raw: []byte("address: 127.0.0.1:50051\nbindTimeout: 2m\n")},
			Args{Address: "127.0.0.1:50051", BindTimeout: metav1Duration(2 * time.Minute)}},
		{"typed", &Args{Socket: "/x.sock"}, Args{Socket: "/x.sock"}},
		{"candidates off", &runtime.Unknown{Raw: []byte(`{"candidateNodes":0}`)}, Args{CandidateNodes: ptr[int32](0)}},
		{"candidates", &runtime.Unknown{Raw: []byte(`{"candidateNodes":500}`)}, Args{CandidateNodes: ptr[int32](500)}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := decodeArgs(tc.obj)
			if err != nil {
				t.Fatalf("decodeArgs: %v", err)
			}
			want := tc.want
			want.setDefaults()
			if !reflect.DeepEqual(*got, want) {
				t.Errorf("args = %+v\nwant   %+v", *got, want)
			}
		})
	}
	d, _ := decodeArgs(nil)
	if d.Socket != "/run/tessera/plugin.sock" || d.Timeout.Duration != 2*time.Second || d.BindTimeout.Duration != time.Minute ||
		d.ResourceCountName != "nvidia.com/gpu" || d.ResourceMemoryName != "nvidia.com/gpumem" ||
		d.ResourceMemoryPercentageName != "nvidia.com/gpumem-percentage" || d.ResourceCoreName != "nvidia.com/gpucores" ||
		*d.CandidateNodes != 20 {
		t.Errorf("defaults = %+v", d)
	}
}

func TestNewRejectsBadArgsWithFieldPath(t *testing.T) {
	cases := []struct {
		name string
		obj  runtime.Object
		want []string
	}{
		{"unknown field", &runtime.Unknown{Raw: []byte(`{"sokcet":"/x"}`)}, []string{`unknown field "sokcet"`}},
		{"not json", &runtime.Unknown{Raw: []byte(`{`)}, []string{"decoding Tessera args"}},
		{"relative socket", &Args{Socket: "plugin.sock"}, []string{"socket: Invalid value", "absolute path"}},
		{"negative timeouts", &Args{Timeout: metav1Duration(-time.Second), BindTimeout: metav1Duration(-time.Second)},
			[]string{"timeout: Invalid value", "bindTimeout: Invalid value"}},
		{"bad resource name", &Args{ResourceCoreName: "not a name"}, []string{"resourceCoreName: Invalid value"}},
		{"negative candidates", &Args{CandidateNodes: ptr[int32](-1)}, []string{"candidateNodes: Invalid value", "0 (every feasible node) or positive"}},
		{"duplicate resource", &Args{ResourceMemoryName: "nvidia.com/gpu"}, []string{"resourceMemoryName: Duplicate value", "same as resourceCountName"}},
		{"wrong type", &metav1.Status{}, []string{"want *runtime.Unknown or *tessera.Args, got *v1.Status"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := New(context.Background(), tc.obj, nil)
			if err == nil {
				t.Fatalf("New accepted %v", tc.obj)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
		})
	}
}

func TestNewWithCustomResourceNames(t *testing.T) {
	p := newTestPlugin(t, &Args{Socket: "/nonexistent/p.sock", ResourceCountName: "example.com/vgpu"})
	if !p.resources.requested(makePod("p").limit("example.com/vgpu", "1").obj()) {
		t.Errorf("custom count resource not recognised")
	}
	if p.resources.requested(makePod("p").gpu("1").obj()) {
		t.Errorf("default nvidia.com/gpu still recognised after renaming")
	}
}
