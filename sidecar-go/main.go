// Command tessera-scheduler is kube-scheduler with the Tessera framework plugin compiled in.
package main

import (
	"os"

	"k8s.io/component-base/cli"
	"k8s.io/kubernetes/cmd/kube-scheduler/app"

	"tessera/sidecar-go/pkg/tessera"
)

func main() {
	command := app.NewSchedulerCommand(app.WithPlugin(tessera.Name, tessera.New))
	os.Exit(cli.Run(command))
}
