package tessera

import (
	"context"
	"testing"

	fwk "k8s.io/kube-scheduler/framework"
)

func TestNormalizeScoreKeepsRangeWithoutStretching(t *testing.T) {
	p := newTestPlugin(t, nil)
	cases := []struct {
		name     string
		in, want []int64
	}{
		{"in range passes unchanged", []int64{30, 40, 0}, []int64{30, 40, 0}},
		{"negative clamps to zero", []int64{-5, 60}, []int64{0, 60}},
		{"above max scales down", []int64{200, 100, 50}, []int64{100, 50, 25}},
		{"empty", nil, nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			scores := make(fwk.NodeScoreList, len(tc.in))
			for i, s := range tc.in {
				scores[i] = fwk.NodeScore{Name: string(rune('a' + i)), Score: s}
			}
			if st := p.NormalizeScore(context.Background(), nil, nil, scores); !st.IsSuccess() {
				t.Fatalf("NormalizeScore = %v", st)
			}
			for i, s := range scores {
				if s.Score != tc.want[i] {
					t.Errorf("scores = %v, want %v", scores, tc.want)
					break
				}
			}
		})
	}
}
