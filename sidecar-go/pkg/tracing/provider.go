// Package tracing builds the shim's OpenTelemetry TracerProvider from the standard OTEL_*
// environment variables and nothing else, so the scheduler config carries no tracing settings.
//
// OTEL_TRACES_EXPORTER selects the exporter: unset or "none" turns tracing off (FromEnv returns
// nil and the plugin takes its no-op path); "otlp" exports over OTLP/gRPC, configured by the
// OTLP exporter's own variables (OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT,
// OTEL_EXPORTER_OTLP_INSECURE, OTEL_EXPORTER_OTLP_HEADERS, ...). Unlike the OpenTelemetry default
// (otlp), unset means off: a scheduler should not try to reach a collector nobody configured.
// The SDK itself reads OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER(_ARG)
// and OTEL_BSP_*; OTEL_SDK_DISABLED=true turns everything off.
package tracing

import (
	"context"
	"fmt"
	"os"
	"strings"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
)

// Environment variables read here (the SDK and the exporter read the others).
const (
	EnvSDKDisabled          = "OTEL_SDK_DISABLED"
	EnvTracesExporter       = "OTEL_TRACES_EXPORTER"
	EnvProtocol             = "OTEL_EXPORTER_OTLP_PROTOCOL"
	EnvTracesProtocol       = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
	exporterNone            = "none"
	exporterOTLP            = "otlp"
	protocolGRPC            = "grpc"
	serviceNameAttributeKey = attribute.Key("service.name")
)

// FromEnv returns a TracerProvider exporting as the environment says, or nil when tracing is
// off. The caller shuts the provider down on exit, which flushes the spans still queued.
func FromEnv(ctx context.Context, defaultService string) (*sdktrace.TracerProvider, error) {
	if strings.EqualFold(strings.TrimSpace(os.Getenv(EnvSDKDisabled)), "true") {
		return nil, nil
	}
	exporters, err := parseExporters(os.Getenv(EnvTracesExporter))
	if err != nil || len(exporters) == 0 {
		return nil, err
	}
	protocol := strings.TrimSpace(os.Getenv(EnvTracesProtocol))
	if protocol == "" {
		protocol = strings.TrimSpace(os.Getenv(EnvProtocol))
	}
	if protocol != "" && protocol != protocolGRPC {
		return nil, fmt.Errorf("%s/%s=%q: only %q is built into tessera-scheduler",
			EnvTracesProtocol, EnvProtocol, protocol, protocolGRPC)
	}
	exp, err := otlptracegrpc.New(ctx)
	if err != nil {
		return nil, fmt.Errorf("OTLP trace exporter from %s: %w", EnvTracesExporter, err)
	}
	res, err := resourceFromEnv(ctx, defaultService)
	if err != nil {
		_ = exp.Shutdown(ctx)
		return nil, err
	}
	return sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res)), nil
}

// resourceFromEnv describes this process: defaultService unless OTEL_SERVICE_NAME or
// OTEL_RESOURCE_ATTRIBUTES name another (later detectors win), plus the SDK's own attributes.
func resourceFromEnv(ctx context.Context, defaultService string) (*resource.Resource, error) {
	res, err := resource.New(ctx,
		resource.WithAttributes(serviceNameAttributeKey.String(defaultService)),
		resource.WithTelemetrySDK(),
		resource.WithFromEnv(),
	)
	if err != nil {
		return nil, fmt.Errorf("trace resource from OTEL_SERVICE_NAME/OTEL_RESOURCE_ATTRIBUTES: %w", err)
	}
	return res, nil
}

// parseExporters reads OTEL_TRACES_EXPORTER's comma list: the exporters to build, none for off.
func parseExporters(value string) ([]string, error) {
	var out []string
	for _, name := range strings.Split(value, ",") {
		switch name = strings.ToLower(strings.TrimSpace(name)); name {
		case "", exporterNone:
		case exporterOTLP:
			if len(out) == 0 {
				out = append(out, name)
			}
		default:
			return nil, fmt.Errorf("%s=%q: unknown exporter %q; tessera-scheduler supports %q and %q",
				EnvTracesExporter, value, name, exporterOTLP, exporterNone)
		}
	}
	return out, nil
}
