// Command tessera-scheduler is kube-scheduler with the Tessera framework plugin compiled in.
// Tracing is configured by the standard OTEL_* environment variables (pkg/tracing); it is off
// unless OTEL_TRACES_EXPORTER says otherwise.
package main

import (
	"context"
	"fmt"
	"net"
	"net/http"
	_ "net/http/pprof" // served only when TESSERA_PPROF_ADDR names a loopback address
	"os"
	"time"

	"go.opentelemetry.io/otel/trace"
	utilfeature "k8s.io/apiserver/pkg/util/feature"
	"k8s.io/component-base/cli"
	"k8s.io/kubernetes/cmd/kube-scheduler/app"
	"k8s.io/kubernetes/pkg/features"

	"tessera/sidecar-go/pkg/tessera"
	"tessera/sidecar-go/pkg/tracing"
)

// serviceName is the default OTEL_SERVICE_NAME.
const serviceName = "tessera-scheduler"

// flushTimeout bounds the export of queued spans at exit.
const flushTimeout = 5 * time.Second

func main() {
	os.Exit(run())
}

// defaultGates are Tessera's feature-gate defaults; --feature-gates still overrides them.
// NominatedNodeNameForExpectation (beta, on upstream) makes kube-scheduler write a pod's
// nominatedNodeName before every PreBind that does work: for Tessera, whose PreBind is one
// annotation patch, that is an extra pod status write per GPU pod (about a fifth of the
// apiserver's work in a burst) that only matters for binds that take long.
//
// SchedulerPopFromBackoffQ (beta, on upstream) lets an idle scheduler pop pods still backing
// off. In 1.36 the members of a pod group retry by backoff alone, so with it a gang that does
// not fit is tried again at once, over and over (a trial reservation of every member each
// time) while nothing else is queued. Off, a failed gang waits its backoff (1 s, doubling to
// 10 s) or an event that may let it fit.
var defaultGates = map[string]bool{
	string(features.NominatedNodeNameForExpectation): false,
	string(features.SchedulerPopFromBackoffQ):        false,
}

// pprofEnv names a loopback HOST:PORT to serve Go's /debug/pprof on (diagnostics; kube-scheduler's
// own endpoint needs its secure port and delegated authentication).
const pprofEnv = "TESSERA_PPROF_ADDR"

func servePprof(addr string) error {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("%s=%q: %w", pprofEnv, addr, err)
	}
	if ip := net.ParseIP(host); host != "localhost" && (ip == nil || !ip.IsLoopback()) {
		return fmt.Errorf("%s=%q: only a loopback address may serve profiles", pprofEnv, addr)
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("%s: %w", pprofEnv, err)
	}
	go func() { _ = http.Serve(ln, nil) }() //nolint:gosec // loopback diagnostics only
	return nil
}

func run() int {
	if addr := os.Getenv(pprofEnv); addr != "" {
		if err := servePprof(addr); err != nil {
			fmt.Fprintf(os.Stderr, "%s: %v\n", serviceName, err)
			return 1
		}
	}
	if err := utilfeature.DefaultMutableFeatureGate.SetFromMap(defaultGates); err != nil {
		fmt.Fprintf(os.Stderr, "%s: feature gates: %v\n", serviceName, err)
		return 1
	}
	sdk, err := tracing.FromEnv(context.Background(), serviceName)
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s: tracing: %v\n", serviceName, err)
		return 1
	}
	var provider trace.TracerProvider // nil: tracing off
	if sdk != nil {
		provider = sdk
		defer func() {
			ctx, cancel := context.WithTimeout(context.Background(), flushTimeout)
			defer cancel()
			if err := sdk.Shutdown(ctx); err != nil {
				fmt.Fprintf(os.Stderr, "%s: flushing traces: %v\n", serviceName, err)
			}
		}()
	}
	command := app.NewSchedulerCommand(app.WithPlugin(tessera.Name, tessera.NewWithTracing(provider)))
	return cli.Run(command)
}
