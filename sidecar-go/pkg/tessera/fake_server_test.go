package tessera

import (
	"context"
	"errors"
	"io"
	"net"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	fwk "k8s.io/kube-scheduler/framework"
	"k8s.io/kubernetes/pkg/scheduler/framework"

	"tessera/sidecar-go/pkg/pluginv1"
)

// fakeServer is an in-process plugin server on a real Unix socket. It answers with whatever the
// test set and records every call, so tests can count round trips.
type fakeServer struct {
	pluginv1.UnimplementedSchedulerServer

	mu        sync.Mutex
	calls     map[string]int
	preFilter *pluginv1.PreFilterResponse
	err       error         // returned by every method when set
	delay     time.Duration // before answering
	lastPF    *pluginv1.PreFilterRequest
	lastRes   *pluginv1.ReserveRequest
	lastUnres *pluginv1.UnreserveRequest
	lastBind  *pluginv1.PreBindRequest
	bindWaits int // PreBind answers ResourceExhausted ("ask again") this many times first
	// noAnnotations: PreBind answers no annotations (a broken server).
	noAnnotations bool
	// emptyCycleAnswers: the Cycle stream answers OK without the call's answer (a broken
	// server), after an answer to an id never sent.
	emptyCycleAnswers bool
	// reserveGate: Reserve answers only once it is closed (nil: at once).
	reserveGate chan struct{}
	// reserveHandsOver: a Reserve asking for hand-over gets the annotations (nothing to wait
	// for on the node), as the real server answers.
	reserveHandsOver bool
	explain          string // Explain's answer
	lastExpl         *pluginv1.ExplainRequest
	// whatIf answers FilterWhatIf (nil: the pod does not fit); whatIfs records the requests.
	whatIf     func(*pluginv1.FilterWhatIfRequest) *pluginv1.FilterWhatIfResponse
	whatIfs    []*pluginv1.FilterWhatIfRequest
	traceparts []string
	// noBefore: Cycle responses do not say handles_before (a server that predates it).
	noBefore bool
	// cycleMessages counts the Cycle stream's requests; order lists its calls as handled.
	cycleMessages int
	order         []string
}

func (s *fakeServer) record(ctx context.Context, method string) error {
	s.mu.Lock()
	s.calls[method]++
	s.order = append(s.order, method)
	if md, ok := metadata.FromIncomingContext(ctx); ok {
		s.traceparts = append(s.traceparts, md.Get("traceparent")...)
	}
	delay, err := s.delay, s.err
	s.mu.Unlock()
	if delay > 0 {
		select {
		case <-time.After(delay):
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return err
}

func (s *fakeServer) PreFilter(ctx context.Context, req *pluginv1.PreFilterRequest) (*pluginv1.PreFilterResponse, error) {
	if err := s.record(ctx, "PreFilter"); err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.lastPF = req
	return s.preFilter, nil
}

func (s *fakeServer) Reserve(ctx context.Context, req *pluginv1.ReserveRequest) (*pluginv1.ReserveResponse, error) {
	if err := s.record(ctx, "Reserve"); err != nil {
		return nil, err
	}
	s.mu.Lock()
	gate := s.reserveGate
	s.mu.Unlock()
	if gate != nil {
		<-gate
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.lastRes = req
	if s.reserveHandsOver && req.GetHandOver() {
		return &pluginv1.ReserveResponse{
			Annotations: map[string]string{"hami.io/vgpu-node": req.GetNode()},
			Labels:      map[string]string{"hami.io/vgpu-node": req.GetNode()},
		}, nil
	}
	return &pluginv1.ReserveResponse{}, nil
}

// Cycle answers the stream's calls one at a time, in order, as the real server does; each
// call's trace context is its incoming metadata.
func (s *fakeServer) Cycle(stream pluginv1.Scheduler_CycleServer) error {
	for {
		req, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		s.mu.Lock()
		empty := s.emptyCycleAnswers
		s.mu.Unlock()
		if empty {
			if err := stream.Send(&pluginv1.CycleResponse{Id: req.GetId() + 1000}); err != nil {
				return err
			}
			if err := stream.Send(&pluginv1.CycleResponse{Id: req.GetId()}); err != nil {
				return err
			}
			continue
		}
		s.mu.Lock()
		s.cycleMessages++
		noBefore := s.noBefore
		s.mu.Unlock()
		// The before calls first, in order, answered in the request's response.
		var before []*pluginv1.CycleResponse
		for _, earlier := range req.GetBefore() {
			before = append(before, s.cycleCall(stream.Context(), earlier))
		}
		resp := s.cycleCall(stream.Context(), req)
		resp.Before, resp.HandlesBefore = before, !noBefore
		if err := stream.Send(resp); err != nil {
			return err
		}
	}
}

// cycleCall answers one call of the stream; its trace context is its incoming metadata.
func (s *fakeServer) cycleCall(ctx context.Context, req *pluginv1.CycleRequest) *pluginv1.CycleResponse {
	if len(req.GetTraceContext()) > 0 {
		ctx = metadata.NewIncomingContext(ctx, metadata.New(req.GetTraceContext()))
	}
	resp := &pluginv1.CycleResponse{Id: req.GetId()}
	var callErr error
	switch call := req.GetCall().(type) {
	case *pluginv1.CycleRequest_PreFilter:
		var answer *pluginv1.PreFilterResponse
		if answer, callErr = s.PreFilter(ctx, call.PreFilter); callErr == nil {
			resp.Answer = &pluginv1.CycleResponse_PreFilter{PreFilter: answer}
		}
	case *pluginv1.CycleRequest_Reserve:
		var answer *pluginv1.ReserveResponse
		if answer, callErr = s.Reserve(ctx, call.Reserve); callErr == nil {
			resp.Answer = &pluginv1.CycleResponse_Reserve{Reserve: answer}
		}
	default:
		callErr = status.Error(codes.InvalidArgument, "the request carries no call")
	}
	if callErr != nil {
		st := status.Convert(callErr)
		resp.Code, resp.Message = uint32(st.Code()), st.Message()
	}
	return resp
}

func (s *fakeServer) Unreserve(ctx context.Context, req *pluginv1.UnreserveRequest) (*pluginv1.UnreserveResponse, error) {
	s.mu.Lock()
	s.lastUnres = req
	s.mu.Unlock()
	if err := s.record(ctx, "Unreserve"); err != nil {
		return nil, err
	}
	return &pluginv1.UnreserveResponse{}, nil
}

func (s *fakeServer) PreBind(ctx context.Context, req *pluginv1.PreBindRequest) (*pluginv1.PreBindResponse, error) {
	if err := s.record(ctx, "PreBind"); err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.lastBind = req
	if s.bindWaits > 0 {
		s.bindWaits--
		return nil, status.Error(codes.ResourceExhausted, "node n1 still allocating default/q; ask again")
	}
	if s.noAnnotations {
		return &pluginv1.PreBindResponse{}, nil
	}
	return &pluginv1.PreBindResponse{
		Annotations: map[string]string{"hami.io/vgpu-node": req.GetNode()},
		Labels:      map[string]string{"hami.io/vgpu-node": req.GetNode()},
	}, nil
}

func (s *fakeServer) Explain(ctx context.Context, req *pluginv1.ExplainRequest) (*pluginv1.ExplainResponse, error) {
	if err := s.record(ctx, "Explain"); err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.lastExpl = req
	return &pluginv1.ExplainResponse{Message: s.explain}, nil
}

func (s *fakeServer) FilterWhatIf(ctx context.Context, req *pluginv1.FilterWhatIfRequest) (*pluginv1.FilterWhatIfResponse, error) {
	if err := s.record(ctx, "FilterWhatIf"); err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.whatIfs = append(s.whatIfs, req)
	if s.whatIf == nil {
		return &pluginv1.FilterWhatIfResponse{Message: "fake: no what-if answer set"}, nil
	}
	return s.whatIf(req), nil
}

// askedWhatIfs returns the FilterWhatIf requests so far.
func (s *fakeServer) askedWhatIfs() []*pluginv1.FilterWhatIfRequest {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.whatIfs)
}

func (s *fakeServer) set(f func(s *fakeServer)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	f(s)
}

// last returns the latest request of each kind (for assertions after a call).
func (s *fakeServer) last() (*pluginv1.PreFilterRequest, *pluginv1.ReserveRequest, *pluginv1.UnreserveRequest, *pluginv1.PreBindRequest) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.lastPF, s.lastRes, s.lastUnres, s.lastBind
}

func (s *fakeServer) count(method string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.calls[method]
}

func (s *fakeServer) total() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, c := range s.calls {
		n += c
	}
	return n
}

// startFake serves a fakeServer on a Unix socket in a temp dir and returns it with a plugin built
// by New (the production path: args decoding, dial, interceptor). Both stop when the test ends.
func startFake(t *testing.T, args *Args) (*fakeServer, *Plugin) {
	t.Helper()
	socket := filepath.Join(t.TempDir(), "plugin.sock")
	lis, err := net.Listen("unix", socket)
	if err != nil {
		t.Fatalf("listen: %v", err)
	}
	srv := grpc.NewServer()
	fake := &fakeServer{calls: map[string]int{}}
	pluginv1.RegisterSchedulerServer(srv, fake)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	if args == nil {
		args = &Args{}
	}
	args.Socket = socket
	return fake, newTestPlugin(t, args)
}

func newTestPlugin(t *testing.T, args *Args) *Plugin {
	t.Helper()
	pl, err := New(context.Background(), args, nil)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	p := pl.(*Plugin)
	t.Cleanup(func() { _ = p.Close() })
	return p
}

// podBuilder builds test pods: makePod("p").gpu(1).mem(3000).annotate(k, v).obj().
type podBuilder struct{ pod *v1.Pod }

func makePod(name string) *podBuilder {
	return &podBuilder{pod: &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default", UID: types.UID("uid-" + name)},
		Spec: v1.PodSpec{Containers: []v1.Container{{
			Name: "main",
			Resources: v1.ResourceRequirements{
				Limits:   v1.ResourceList{v1.ResourceCPU: resource.MustParse("1")},
				Requests: v1.ResourceList{v1.ResourceCPU: resource.MustParse("1")},
			},
		}}},
	}}
}

func (b *podBuilder) limit(name string, value string) *podBuilder {
	b.pod.Spec.Containers[0].Resources.Limits[v1.ResourceName(name)] = resource.MustParse(value)
	return b
}

func (b *podBuilder) gpu(n string) *podBuilder { return b.limit(DefaultResourceCountName, n) }
func (b *podBuilder) mem(n string) *podBuilder { return b.limit(DefaultResourceMemoryName, n) }

func (b *podBuilder) initLimit(name, value string) *podBuilder {
	b.pod.Spec.InitContainers = append(b.pod.Spec.InitContainers, v1.Container{
		Name:      "init",
		Resources: v1.ResourceRequirements{Limits: v1.ResourceList{v1.ResourceName(name): resource.MustParse(value)}},
	})
	return b
}

// host replaces the main container's CPU and memory requests and limits (nil: none).
func (b *podBuilder) host(values map[v1.ResourceName]string) *podBuilder {
	res := &b.pod.Spec.Containers[0].Resources
	for _, name := range []v1.ResourceName{v1.ResourceCPU, v1.ResourceMemory} {
		delete(res.Limits, name)
		delete(res.Requests, name)
	}
	for name, value := range values {
		res.Limits[name] = resource.MustParse(value)
		res.Requests[name] = resource.MustParse(value)
	}
	return b
}

func (b *podBuilder) annotate(k, v string) *podBuilder {
	if b.pod.Annotations == nil {
		b.pod.Annotations = map[string]string{}
	}
	b.pod.Annotations[k] = v
	return b
}

func (b *podBuilder) label(k, v string) *podBuilder {
	if b.pod.Labels == nil {
		b.pod.Labels = map[string]string{}
	}
	b.pod.Labels[k] = v
	return b
}

func (b *podBuilder) priority(p int32) *podBuilder {
	b.pod.Spec.Priority = &p
	return b
}

func (b *podBuilder) obj() *v1.Pod { return b.pod }

func nodeInfo(name string) fwk.NodeInfo {
	ni := framework.NewNodeInfo()
	ni.SetNode(&v1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}})
	return ni
}

func newState() fwk.CycleState { return framework.NewCycleState() }

func okResponse() *pluginv1.PreFilterResponse {
	return &pluginv1.PreFilterResponse{
		Code:              pluginv1.PreFilterResponse_OK,
		FeasibleNodes:     []string{"n1", "n2"},
		Scores:            []int64{30, 80},
		InfeasibleMessage: "insufficient GPU memory (want 3000 MiB, largest free 2048 MiB)",
		DecisionId:        42,
	}
}
