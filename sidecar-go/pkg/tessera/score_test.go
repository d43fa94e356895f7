package tessera

import (
	"strings"
	"testing"

	"tessera/sidecar-go/pkg/pluginv1"
)

func TestScoresPassUnchangedAndOutOfRangeOnesAreRefused(t *testing.T) {
	p := newTestPlugin(t, nil)
	if p.ScoreExtensions() != nil {
		t.Fatal("ScoreExtensions: the server's scores are on kube-scheduler's scale already")
	}
	cases := []struct {
		name   string
		scores []int64
		bad    string
	}{
		{"in range", []int64{0, 37, 100}, ""},
		{"negative", []int64{10, -1}, "node n1 scored -1, outside 0..100"},
		{"above the maximum", []int64{101}, "node n0 scored 101, outside 0..100"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			resp := &pluginv1.PreFilterResponse{Code: pluginv1.PreFilterResponse_OK, DecisionId: 1}
			for i, s := range tc.scores {
				resp.FeasibleNodes = append(resp.FeasibleNodes, "n"+string(rune('0'+i)))
				resp.Scores = append(resp.Scores, s)
			}
			state := newState()
			_, st := answerPreFilter(state, resp, nil, nil, p.args.Timeout.Duration)
			if tc.bad == "" {
				if !st.IsSuccess() {
					t.Fatalf("status = %v", st)
				}
				d, err := readDecision(state)
				if err != nil {
					t.Fatal(err)
				}
				for i, s := range tc.scores {
					if got := d.scores[resp.FeasibleNodes[i]]; got != s {
						t.Errorf("node %s: score %d, want %d unchanged", resp.FeasibleNodes[i], got, s)
					}
				}
				return
			}
			if st.IsSuccess() || !strings.Contains(st.Message(), tc.bad) {
				t.Fatalf("status = %v, want an error naming %q", st, tc.bad)
			}
		})
	}
}
