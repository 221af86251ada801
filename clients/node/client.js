#!/usr/bin/env node
// A small Node client of Replicaplane's controller, built from the repository's protos at run
// time with @grpc/proto-loader (no generated code).
//
//   node client.js [--controller host:port] list
//   node client.js [--controller host:port] watch NAME [--until-ready N] [--timeout S]
//
// The address defaults to $REPLICAPLANE_CONTROLLER, else 127.0.0.1:50051. `list` prints one
// JSON line per service; `watch` prints one JSON line per WatchService message (a snapshot, then
// every change) and, with --until-ready N, exits 0 once N replicas are READY.
"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTOS = path.resolve(__dirname, "..", "..", "protos");

function loadController() {
  const definition = protoLoader.loadSync("replicaplane/controller/v1/controller_service.proto", {
    includeDirs: [PROTOS],
    keepCase: true, // field names as in the protos (ready_replicas), like grpcurl and replicactl
    longs: String, // int64 as strings, as protobuf's JSON mapping does
    enums: String, // enum value names (SERVICE_STATUS_READY)
    defaults: true,
    oneofs: true,
  });
  return grpc.loadPackageDefinition(definition).replicaplane.controller.v1.ControllerService;
}

function parseArgs(argv) {
  const opts = {
    controller: process.env.REPLICAPLANE_CONTROLLER || "127.0.0.1:50051",
    untilReady: 0,
    timeout: 120,
    positional: [],
  };
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i];
    if (arg === "--controller") opts.controller = argv[++i];
    else if (arg === "--until-ready") opts.untilReady = Number(argv[++i]);
    else if (arg === "--timeout") opts.timeout = Number(argv[++i]);
    else opts.positional.push(arg);
  }
  return opts;
}

function fail(message, code) {
  process.stderr.write(`error: ${message}\n`);
  process.exit(code);
}

// The bearer token of a controller that requires one: $REPLICAPLANE_API_TOKEN (never printed).
function metadata() {
  const md = new grpc.Metadata();
  if (process.env.REPLICAPLANE_API_TOKEN) md.set("authorization", `Bearer ${process.env.REPLICAPLANE_API_TOKEN}`);
  return md;
}

function list(client, opts) {
  const deadline = new Date(Date.now() + 10000);
  client.ListServices({ page_size: 1000 }, metadata(), { deadline }, (err, resp) => {
    if (err) fail(`${grpc.status[err.code]}: ${err.details}`, 1);
    for (const svc of resp.services) {
      const line = {
        name: svc.name,
        status: svc.status,
        ready_replicas: svc.ready_replicas,
        total_replicas: svc.total_replicas,
        versions: svc.active_versions,
      };
      process.stdout.write(JSON.stringify(line) + "\n");
    }
    process.exit(0);
  });
}

function watch(client, opts, name) {
  if (!name) fail("watch needs a service name", 2);
  const ready = new Map(); // replica id -> status, kept up to date from snapshots and changes
  const call = client.WatchService({ service_name: name, after_sequence: 0 }, metadata());
  const timer = setTimeout(() => {
    call.cancel();
    fail(`gave up after ${opts.timeout} s`, 5);
  }, opts.timeout * 1000);
  call.on("data", (msg) => {
    if (msg.snapshot) ready.clear();
    for (const r of msg.replicas) ready.set(r.replica_id, r.status);
    for (const id of msg.removed_replica_ids) ready.delete(id);
    process.stdout.write(JSON.stringify(msg) + "\n");
    const count = [...ready.values()].filter((s) => s === "REPLICA_STATUS_READY").length;
    if (msg.deleted || (opts.untilReady > 0 && count >= opts.untilReady)) {
      clearTimeout(timer);
      call.cancel();
      process.exit(0);
    }
  });
  call.on("error", (err) => {
    if (err.code === grpc.status.CANCELLED) return;
    clearTimeout(timer);
    fail(`${grpc.status[err.code]}: ${err.details}`, err.code === grpc.status.NOT_FOUND ? 3 : 1);
  });
  call.on("end", () => {
    clearTimeout(timer);
    process.exit(0);
  });
}

function main() {
  const opts = parseArgs(process.argv.slice(2));
  const Service = loadController();
  const client = new Service(opts.controller, grpc.credentials.createInsecure());
  const [command, name] = opts.positional;
  if (command === "list") list(client, opts);
  else if (command === "watch") watch(client, opts, name);
  else fail("usage: client.js [--controller host:port] list | watch NAME [--until-ready N]", 2);
}

main();
