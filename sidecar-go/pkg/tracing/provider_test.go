package tracing

import (
	"context"
	"strings"
	"testing"

	"go.opentelemetry.io/otel/attribute"
)

// unsetEnv clears every variable FromEnv reads, so the host's environment cannot leak in.
func unsetEnv(t *testing.T) {
	t.Helper()
	for _, k := range []string{EnvSDKDisabled, EnvTracesExporter, EnvProtocol, EnvTracesProtocol,
		"OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_EXPORTER_OTLP_ENDPOINT"} {
		t.Setenv(k, "")
	}
}

func TestFromEnv(t *testing.T) {
	cases := []struct {
		name    string
		env     map[string]string
		want    bool   // a provider
		wantErr string // substring
	}{
		{name: "unset is off", env: nil},
		{name: "none is off", env: map[string]string{EnvTracesExporter: "none"}},
		{name: "otlp", env: map[string]string{EnvTracesExporter: "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"}, want: true},
		{name: "otlp listed twice, spaces and case", env: map[string]string{EnvTracesExporter: " OTLP, otlp "}, want: true},
		{name: "otlp over grpc said explicitly", env: map[string]string{EnvTracesExporter: "otlp", EnvProtocol: "grpc"}, want: true},
		{name: "sdk disabled wins", env: map[string]string{EnvTracesExporter: "otlp", EnvSDKDisabled: "TRUE"}},
		{name: "unknown exporter", env: map[string]string{EnvTracesExporter: "otlp,zipkin"},
			wantErr: `OTEL_TRACES_EXPORTER="otlp,zipkin": unknown exporter "zipkin"; tessera-scheduler supports "otlp" and "none"`},
		{name: "http protocol not built in", env: map[string]string{EnvTracesExporter: "otlp", EnvProtocol: "http/protobuf"},
			wantErr: `only "grpc" is built into tessera-scheduler`},
		{name: "traces protocol overrides the general one", env: map[string]string{EnvTracesExporter: "otlp", EnvProtocol: "grpc", EnvTracesProtocol: "http/json"},
			wantErr: `"http/json"`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			unsetEnv(t)
			for k, v := range tc.env {
				t.Setenv(k, v)
			}
			tp, err := FromEnv(context.Background(), "svc")
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err = %v, want it to contain %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("FromEnv: %v", err)
			}
			if got := tp != nil; got != tc.want {
				t.Fatalf("provider = %v, want one: %v", tp, tc.want)
			}
			if tp != nil {
				if err := tp.Shutdown(context.Background()); err != nil {
					t.Errorf("Shutdown: %v", err)
				}
			}
		})
	}
}

func TestResourceServiceName(t *testing.T) {
	cases := []struct {
		name, serviceEnv, attrsEnv, want string
	}{
		{"default", "", "", "tessera-scheduler"},
		{"OTEL_SERVICE_NAME", "sched-a", "", "sched-a"},
		{"OTEL_RESOURCE_ATTRIBUTES", "", "service.name=sched-b,team=gpu", "sched-b"},
		{"OTEL_SERVICE_NAME beats the attributes", "sched-c", "service.name=sched-b", "sched-c"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			unsetEnv(t)
			t.Setenv("OTEL_SERVICE_NAME", tc.serviceEnv)
			t.Setenv("OTEL_RESOURCE_ATTRIBUTES", tc.attrsEnv)
			res, err := resourceFromEnv(context.Background(), "tessera-scheduler")
			if err != nil {
				t.Fatalf("resourceFromEnv: %v", err)
			}
			got, _ := res.Set().Value(attribute.Key("service.name"))
			if got.AsString() != tc.want {
				t.Errorf("service.name = %q, want %q", got.AsString(), tc.want)
			}
		})
	}
}
