// Package tessera is the kube-scheduler framework plugin that forwards Tessera's scheduling
// decisions to the Python plugin server over gRPC. It owns no scheduling logic: PreFilter asks the
// server once per cycle for every node's verdict and score, Filter and Score read that answer from
// CycleState; PreFilter and Reserve travel over one ordered stream and the binding cycle reads
// Reserve's answer, and Unreserve/PreBind are single calls. Only preemption's dry run asks
// more: FilterWhatIf, for a preemptible node some of whose GPU pods count as gone. Pods that
// request no Tessera resource never reach the server.
package tessera

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/apimachinery/pkg/util/validation/field"
	fwk "k8s.io/kube-scheduler/framework"
	"sigs.k8s.io/yaml"

	"tessera/sidecar-go/pkg/pluginv1"
)

// Name is the plugin's name in KubeSchedulerConfiguration profiles.
const Name = "Tessera"

// Defaults for Args; every default lives here.
const (
	DefaultSocket                       = "/run/tessera/plugin.sock"
	DefaultTimeout                      = 2 * time.Second
	DefaultBindTimeout                  = 60 * time.Second
	DefaultResourceCountName            = "nvidia.com/gpu"
	DefaultResourceMemoryName           = "nvidia.com/gpumem"
	DefaultResourceMemoryPercentageName = "nvidia.com/gpumem-percentage"
	DefaultResourceCoreName             = "nvidia.com/gpucores"
	// DefaultCandidateNodes: kube-scheduler filters and scores this many of Tessera's best
	// nodes (it would otherwise sample 40-50% of every feasible node, one by one). Offered 100
	// in a 1000-node drain, it took Tessera's best node for 90% of the pods and one of the best
	// 20 for 93%; each candidate costs the serial cycle its filters and scores.
	DefaultCandidateNodes int32 = 20
)

// Args are the plugin's pluginConfig args. Resource names use the same keys as HAMi's device
// config (resourceCountName, ...), so one set of names configures both.
type Args struct {
	// Socket is the plugin server's Unix socket, shared by the scheduler pod's containers.
	Socket string `json:"socket,omitempty"`
	// Address is a TCP host:port used instead of Socket; for development only.
	Address string `json:"address,omitempty"`
	// Timeout bounds PreFilter, Reserve and Unreserve calls.
	Timeout metav1.Duration `json:"timeout,omitempty"`
	// BindTimeout bounds PreBind, which may wait for an earlier pod on the same node.
	BindTimeout metav1.Duration `json:"bindTimeout,omitempty"`

	// CandidateNodes caps the nodes PreFilter hands kube-scheduler for a GPU pod without a
	// node selector, affinity or topology spread: the best by Tessera's score. 0: every
	// feasible node. If the other plugins reject them all, the pod is tried again at once
	// with every feasible node.
	CandidateNodes *int32 `json:"candidateNodes,omitempty"`

	// HostOnlyPods: ask the plugin server about every pod that requests no Tessera resource
	// (it places them under the fragmentation policy; set when the webhook routes such pods
	// here). Otherwise only those that name the fragmentation policy themselves are asked;
	// the rest are kube-scheduler's without a call.
	HostOnlyPods bool `json:"hostOnlyPods,omitempty"`

	ResourceCountName            string `json:"resourceCountName,omitempty"`
	ResourceMemoryName           string `json:"resourceMemoryName,omitempty"`
	ResourceMemoryPercentageName string `json:"resourceMemoryPercentageName,omitempty"`
	ResourceCoreName             string `json:"resourceCoreName,omitempty"`
}

// DeepCopyObject lets *Args be passed to New directly (tests, embedding binaries).
func (a *Args) DeepCopyObject() runtime.Object {
	c := *a
	return &c
}

// GetObjectKind implements runtime.Object; Args carry no type metadata.
func (a *Args) GetObjectKind() schema.ObjectKind { return schema.EmptyObjectKind }

func (a *Args) setDefaults() {
	if a.Socket == "" {
		a.Socket = DefaultSocket
	}
	if a.Timeout.Duration == 0 {
		a.Timeout.Duration = DefaultTimeout
	}
	if a.BindTimeout.Duration == 0 {
		a.BindTimeout.Duration = DefaultBindTimeout
	}
	if a.CandidateNodes == nil {
		n := DefaultCandidateNodes
		a.CandidateNodes = &n
	}
	if a.ResourceCountName == "" {
		a.ResourceCountName = DefaultResourceCountName
	}
	if a.ResourceMemoryName == "" {
		a.ResourceMemoryName = DefaultResourceMemoryName
	}
	if a.ResourceMemoryPercentageName == "" {
		a.ResourceMemoryPercentageName = DefaultResourceMemoryPercentageName
	}
	if a.ResourceCoreName == "" {
		a.ResourceCoreName = DefaultResourceCoreName
	}
}

// validate reports every bad field with its path.
func (a *Args) validate() error {
	var errs field.ErrorList
	if a.Address == "" && !filepath.IsAbs(a.Socket) {
		errs = append(errs, field.Invalid(field.NewPath("socket"), a.Socket, "must be an absolute path"))
	}
	if a.Timeout.Duration <= 0 {
		errs = append(errs, field.Invalid(field.NewPath("timeout"), a.Timeout.Duration.String(), "must be positive"))
	}
	if a.BindTimeout.Duration <= 0 {
		errs = append(errs, field.Invalid(field.NewPath("bindTimeout"), a.BindTimeout.Duration.String(), "must be positive"))
	}
	if *a.CandidateNodes < 0 {
		errs = append(errs, field.Invalid(field.NewPath("candidateNodes"), *a.CandidateNodes, "must be 0 (every feasible node) or positive"))
	}
	seen := map[string]string{}
	for _, r := range []struct{ key, value string }{
		{"resourceCountName", a.ResourceCountName},
		{"resourceMemoryName", a.ResourceMemoryName},
		{"resourceMemoryPercentageName", a.ResourceMemoryPercentageName},
		{"resourceCoreName", a.ResourceCoreName},
	} {
		path := field.NewPath(r.key)
		for _, msg := range validation.IsQualifiedName(r.value) {
			errs = append(errs, field.Invalid(path, r.value, msg))
		}
		if other, dup := seen[r.value]; dup {
			errs = append(errs, field.Duplicate(path, fmt.Sprintf("%s (same as %s)", r.value, other)))
		}
		seen[r.value] = r.key
	}
	return errs.ToAggregate()
}

// decodeArgs accepts what kube-scheduler passes (runtime.Unknown holding JSON or YAML), a ready
// *Args, or nil (all defaults). Unknown fields are errors so a typo doesn't silently default.
func decodeArgs(obj runtime.Object) (*Args, error) {
	args := &Args{}
	switch o := obj.(type) {
	case nil:
	case *runtime.Unknown:
		if len(o.Raw) > 0 {
			if err := yaml.UnmarshalStrict(o.Raw, args); err != nil {
				return nil, fmt.Errorf("decoding %s args: %w", Name, err)
			}
		}
	case *Args:
		if o != nil {
			*args = *o
		}
	default:
		return nil, fmt.Errorf("%s args: want *runtime.Unknown or *tessera.Args, got %T", Name, obj)
	}
	args.setDefaults()
	if err := args.validate(); err != nil {
		return nil, fmt.Errorf("invalid %s args: %w", Name, err)
	}
	return args, nil
}

// Plugin is the Tessera framework plugin. It is safe for concurrent use: its fields are set once
// in New, and per-pod data lives in CycleState.
type Plugin struct {
	args      Args
	resources resourceNames
	client    pluginv1.SchedulerClient
	// cycle carries PreFilter and Reserve, in order, over one stream.
	cycle *cycleStream
	// tracing is off (zero) unless built by NewWithTracing with a provider.
	tracing tracing
	// closeConn releases the gRPC connection; nil when the client was injected.
	closeConn func() error
	// handle is kube-scheduler's framework (nil in tests that bind nothing).
	handle fwk.Handle
	// handsOver: Tessera's Bind runs first, so PreBind leaves the annotations to it
	// (bindsFirst decides once).
	bindOrder sync.Once
	handsOver bool
	// postFilterOrder: checkPreemptsAfter logs a profile without DefaultPreemption after
	// Tessera once.
	postFilterOrder sync.Once
	// wide holds pods whose candidates were all rejected: they get every feasible node.
	wide wideSet
	// events: when the last node or GPU pod event arrived (retryIfStale).
	events eventClock
}

var (
	_ fwk.PreFilterPlugin     = &Plugin{}
	_ fwk.PreFilterExtensions = &Plugin{}
	_ fwk.FilterPlugin        = &Plugin{}
	_ fwk.PostFilterPlugin    = &Plugin{}
	_ fwk.PreScorePlugin      = &Plugin{}
	_ fwk.ScorePlugin         = &Plugin{}
	_ fwk.ReservePlugin       = &Plugin{}
	_ fwk.PreBindPlugin       = &Plugin{}
	_ fwk.BindPlugin          = &Plugin{}
	_ fwk.SignPlugin          = &Plugin{}
	_ fwk.EnqueueExtensions   = &Plugin{}
)

// New is the plugin factory registered with app.WithPlugin.
func New(ctx context.Context, obj runtime.Object, h fwk.Handle) (fwk.Plugin, error) {
	args, err := decodeArgs(obj)
	if err != nil {
		return nil, err
	}
	if h != nil && h.ClientSet() != nil {
		if err := checkGangAPI(h.ClientSet().Discovery()); err != nil {
			return nil, err
		}
	}
	conn, err := dial(args)
	if err != nil {
		return nil, err
	}
	p := newPlugin(args, pluginv1.NewSchedulerClient(conn))
	p.closeConn = conn.Close
	p.handle = h
	return p, nil
}

// newPlugin wires a plugin to a client; New passes one dialled from the args.
func newPlugin(args *Args, client pluginv1.SchedulerClient) *Plugin {
	return &Plugin{
		args: *args,
		resources: resourceNames{
			v1.ResourceName(args.ResourceCountName), v1.ResourceName(args.ResourceMemoryName),
			v1.ResourceName(args.ResourceMemoryPercentageName), v1.ResourceName(args.ResourceCoreName),
		},
		client: client,
		cycle:  newCycleStream(client, reserveWindow),
	}
}

// Name implements fwk.Plugin.
func (p *Plugin) Name() string { return Name }

// Close releases the gRPC connection (kube-scheduler calls it on shutdown via io.Closer).
func (p *Plugin) Close() error {
	p.cycle.Close()
	if p.closeConn == nil {
		return nil
	}
	return p.closeConn()
}

// errNoDecision means PreFilter stored nothing for this pod: it asked for no Tessera resource.
var errNoDecision = errors.New("no Tessera decision in CycleState")
