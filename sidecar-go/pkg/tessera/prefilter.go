package tessera

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"

	"tessera/sidecar-go/pkg/pluginv1"
)

const decisionKey fwk.StateKey = Name + "/decision"

// The node policy annotation, and the policy under which the server places pods that request
// no Tessera resource.
const (
	nodePolicyAnnotation = "hami.io/node-scheduler-policy"
	fragmentationPolicy  = "fragmentation"
)

// decision is the plugin server's answer for one pod in one cycle. It is never mutated after
// PreFilter, so Clone can share it.
type decision struct {
	id uint64
	// scores holds every feasible node's score; a node absent here does not fit.
	scores map[string]int64
	// preemptible holds the nodes that do not fit but would without some of the pod's
	// lower-priority pods: the only nodes where Filter answers Unschedulable (preemption may
	// help) rather than UnschedulableAndUnresolvable, and asks FilterWhatIf in a dry run.
	preemptible sets.Set[string]
	// podJSON is the pod as PreFilter sent it, kept for FilterWhatIf (only with preemptible).
	podJSON           []byte
	infeasibleMessage string
	// feasibleTotal > 0: scores holds only the best candidates of that many feasible nodes.
	feasibleTotal uint32
	// hostOnly: the pod asks for no Tessera resource; the server placed it by its CPU and
	// memory (the fragmentation policy). Reserve counts them there; nothing is handed over,
	// written or waited for at PreBind, and DefaultBinder binds it.
	hostOnly bool
}

// rejection is a rejected node's Filter message.
func (d *decision) rejection() string {
	if d.infeasibleMessage == "" {
		// The server explains lazily: PostFilter asks for the details if the cycle fails.
		return genericInfeasible
	}
	return d.infeasibleMessage
}

// Clone implements fwk.StateData.
func (d *decision) Clone() fwk.StateData { return d }

func readDecision(state fwk.CycleState) (*decision, error) {
	data, err := state.Read(decisionKey)
	if err != nil {
		return nil, errNoDecision
	}
	d, ok := data.(*decision)
	if !ok {
		return nil, fmt.Errorf("%s: CycleState %q holds %T, want *decision", Name, decisionKey, data)
	}
	return d, nil
}

func podRef(pod *v1.Pod) *pluginv1.PodRef {
	return &pluginv1.PodRef{Namespace: pod.Namespace, Name: pod.Name, Uid: string(pod.UID)}
}

// PreFilter asks the plugin server, once per cycle, for every node's verdict and score. A pod
// that requests no Tessera resource is the server's only under the fragmentation policy (it
// answers Skip otherwise), and is asked about only with HostOnlyPods or when it names that
// policy; once the best nodes it offered such a pod were all rejected, the next attempt is
// kube-scheduler's alone.
func (p *Plugin) PreFilter(ctx context.Context, state fwk.CycleState, pod *v1.Pod, _ []fwk.NodeInfo) (*fwk.PreFilterResult, *fwk.Status) {
	hostOnly := !p.resources.requested(pod)
	if hostOnly && !p.args.HostOnlyPods && pod.Annotations[nodePolicyAnnotation] != fragmentationPolicy {
		return nil, fwk.NewStatus(fwk.Skip)
	}
	if hostOnly && p.wide.has(pod.UID) {
		p.wide.remove(pod.UID)
		return nil, fwk.NewStatus(fwk.Skip)
	}
	ctx, traced := p.tracing.startAttempt(ctx, state, pod)
	state.Write(askedKey, askedAt(time.Now()))
	podJSON, err := encodePod(pod)
	var resp *pluginv1.PreFilterResponse
	if err == nil {
		resp, err = p.askPreFilter(ctx, pod, podJSON)
	}
	if hostOnly && err != nil {
		// Such a pod needs nothing of the server: it goes on without it.
		klog.FromContext(ctx).V(2).Info("PreFilter of a pod without a GPU failed; leaving it to kube-scheduler",
			"plugin", Name, "pod", klog.KObj(pod), "err", err)
		st := fwk.NewStatus(fwk.Skip)
		traced.endPreFilter(st, nil, err, p.tracing.grace)
		return nil, st
	}
	res, st := answerPreFilter(state, resp, err, podJSON, p.args.Timeout.Duration)
	traced.endPreFilter(st, resp, err, p.tracing.grace)
	if !st.IsSuccess() {
		return res, st
	}
	if hostOnly {
		if d, err := readDecision(state); err == nil {
			d.hostOnly = true
		}
		return res, st
	}
	trimFitRequests(state, p.resources[1:])
	return res, st
}

// hostOnlyDecision says whether this cycle's decision is for a pod without a Tessera resource.
func hostOnlyDecision(state fwk.CycleState) bool {
	d, err := readDecision(state)
	return err == nil && d.hostOnly
}

// errEncodingPod marks a pod the shim could not encode; nothing was sent.
var errEncodingPod = errors.New("encoding pod")

// encodePod is the pod as the server reads it. managedFields is often the bulk of a pod's
// JSON and nothing the server reads.
func encodePod(pod *v1.Pod) ([]byte, error) {
	trimmed := *pod
	trimmed.ManagedFields = nil
	podJSON, err := json.Marshal(&trimmed)
	if err != nil {
		return nil, fmt.Errorf("%s: %w %s/%s: %w", Name, errEncodingPod, pod.Namespace, pod.Name, err)
	}
	return podJSON, nil
}

func (p *Plugin) askPreFilter(ctx context.Context, pod *v1.Pod, podJSON []byte) (*pluginv1.PreFilterResponse, error) {
	callCtx, cancel := context.WithTimeout(ctx, p.args.Timeout.Duration)
	defer cancel()
	return p.cycle.preFilter(callCtx, &pluginv1.PreFilterRequest{
		Version:        pluginv1.ProtocolVersion_PROTOCOL_VERSION_1,
		Pod:            podRef(pod),
		PodJson:        podJSON,
		CandidateNodes: p.candidateNodes(pod),
	})
}

// candidateNodes is how many of the best feasible nodes to ask for (0: all). Pods another
// plugin is likely to narrow to few nodes (node selector, affinity, topology spread), and pods
// whose candidates were all rejected before, get every feasible node; so do pods nominated by
// preemption, whose nominated node kube-scheduler tries first and a limit could leave out.
func (p *Plugin) candidateNodes(pod *v1.Pod) uint32 {
	limit := *p.args.CandidateNodes
	if limit <= 0 || pod.Spec.NodeSelector != nil || pod.Spec.Affinity != nil ||
		len(pod.Spec.TopologySpreadConstraints) > 0 || pod.Status.NominatedNodeName != "" || p.wide.has(pod.UID) {
		return 0
	}
	return uint32(limit)
}

// answerPreFilter turns the server's answer into the framework's, storing a decision for an OK
// answer and for an UNSCHEDULABLE one that names preemptible nodes.
func answerPreFilter(state fwk.CycleState, resp *pluginv1.PreFilterResponse, err error, podJSON []byte, timeout time.Duration) (*fwk.PreFilterResult, *fwk.Status) {
	if errors.Is(err, errEncodingPod) {
		return nil, fwk.AsStatus(err)
	}
	if err != nil {
		return nil, rpcFailure("PreFilter", timeout, err)
	}
	switch resp.GetCode() {
	case pluginv1.PreFilterResponse_OK:
		return storeDecision(state, resp, podJSON)
	case pluginv1.PreFilterResponse_SKIP:
		return nil, fwk.NewStatus(fwk.Skip)
	case pluginv1.PreFilterResponse_UNSCHEDULABLE:
		if len(resp.GetPreemptibleNodes()) > 0 {
			// No node fits now, but preemption may make room: Success with the decision, so
			// Filter runs and tells DefaultPreemption which nodes to try (an Unresolvable
			// PreFilter would rule out every node).
			return storeDecision(state, resp, podJSON)
		}
		return nil, fwk.NewStatus(fwk.UnschedulableAndUnresolvable, infeasibleMessage(resp))
	case pluginv1.PreFilterResponse_INVALID:
		return nil, fwk.NewStatus(fwk.UnschedulableAndUnresolvable, resp.GetMessage())
	default:
		return nil, fwk.AsStatus(fmt.Errorf("tessera plugin server failed PreFilter: unknown response code %v", resp.GetCode()))
	}
}

// infeasibleMessage is why no node fits: the header-less per-class reasons (kube-scheduler adds
// its own "0/N nodes" count).
func infeasibleMessage(resp *pluginv1.PreFilterResponse) string {
	if msg := resp.GetInfeasibleMessage(); msg != "" {
		return msg
	}
	return resp.GetMessage()
}

func storeDecision(state fwk.CycleState, resp *pluginv1.PreFilterResponse, podJSON []byte) (*fwk.PreFilterResult, *fwk.Status) {
	nodes, scores, preemptible := resp.GetFeasibleNodes(), resp.GetScores(), resp.GetPreemptibleNodes()
	if len(nodes) != len(scores) {
		return nil, fwk.AsStatus(fmt.Errorf("tessera plugin server failed PreFilter: %d feasible nodes but %d scores", len(nodes), len(scores)))
	}
	if len(nodes) == 0 && len(preemptible) == 0 {
		return nil, fwk.NewStatus(fwk.UnschedulableAndUnresolvable, infeasibleMessage(resp))
	}
	for i, s := range scores {
		if s < 0 || s > fwk.MaxNodeScore {
			return nil, fwk.AsStatus(fmt.Errorf("tessera plugin server failed PreFilter: node %s scored %d, outside 0..%d", nodes[i], s, fwk.MaxNodeScore))
		}
	}
	d := &decision{
		id:                resp.GetDecisionId(),
		scores:            make(map[string]int64, len(nodes)),
		infeasibleMessage: resp.GetInfeasibleMessage(),
		feasibleTotal:     resp.GetFeasibleTotal(),
	}
	if resp.GetCode() == pluginv1.PreFilterResponse_UNSCHEDULABLE {
		d.infeasibleMessage = infeasibleMessage(resp)
	}
	names := sets.New[string]()
	for i, n := range nodes {
		d.scores[n] = scores[i]
		names.Insert(n)
	}
	if len(preemptible) > 0 {
		d.preemptible = sets.New(preemptible...)
		d.podJSON = podJSON
		// Preemption dry-runs only nodes whose Filter said Unschedulable; a node left out of
		// the PreFilterResult counts as UnschedulableAndUnresolvable.
		names = names.Union(d.preemptible)
	}
	state.Write(decisionKey, d)
	if d.infeasibleMessage != "" {
		// The server explained the rejected nodes: Filter (a map lookup) passes that on to
		// the pod's PodScheduled condition, which a node set would replace with "didn't
		// satisfy plugin(s)".
		return nil, nil
	}
	// The feasible and preemptible nodes as the PreFilterResult: kube-scheduler then runs no
	// filter (its own included, e.g. NodeResourcesFit's per-resource checks) on nodes Tessera
	// already rejected. Their explanation comes from PostFilter if the cycle fails.
	return &fwk.PreFilterResult{NodeNames: names}, nil
}

// PreFilterExtensions returns the plugin: its AddPod/RemovePod record preemption's what-ifs
// (whatif.go).
func (p *Plugin) PreFilterExtensions() fwk.PreFilterExtensions { return p }
