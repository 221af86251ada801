#!/usr/bin/env node
// A small Node client of Replicaplane's controller, built from the repository's protos at run
// time with @grpc/proto-loader (no generated code).
//
//   node client.js [--controller host:port[,host:port...]] list
//   node client.js [--controller host:port[,host:port...]] watch NAME [--until-ready N] [--timeout S]
//
// The address defaults to $REPLICAPLANE_CONTROLLER, else 127.0.0.1:50051. With several (controllers
// sharing a store, one leading), a call that finds one unavailable goes to the next, for up to
// FAILOVER_MS; a standby forwards calls to the leader. `list` prints one
// JSON line per service; `watch` prints one JSON line per WatchService message (a snapshot, then
// every change) and, with --until-ready N, exits 0 once N replicas are READY.
"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTOS = path.resolve(__dirname, "..", "..", "protos");
const FAILOVER_MS = 20000; // how long a call is retried while controllers hand over the lead

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

// One client per address, used in turn: `next()` moves on after an UNAVAILABLE answer.
class Controllers {
  constructor(Service, addrs) {
    this.clients = addrs.split(",").map((a) => new Service(a.trim(), grpc.credentials.createInsecure()));
    this.index = 0;
  }
  get current() {
    return this.clients[this.index];
  }
  next() {
    this.index = (this.index + 1) % this.clients.length;
    return this.current;
  }
}

// UNAVAILABLE with more than one controller (the next may lead), or an answer that no
// controller leads right now: worth another try.
function failover(err, controllers) {
  if (err.code !== grpc.status.UNAVAILABLE) return false;
  return controllers.clients.length > 1 || /no (controller leads|longer leads)/.test(err.details || "");
}

function list(controllers, opts, started = Date.now()) {
  const deadline = new Date(Date.now() + 10000);
  controllers.current.ListServices({ page_size: 1000 }, metadata(), { deadline }, (err, resp) => {
    if (err && failover(err, controllers) && Date.now() - started < FAILOVER_MS) {
      controllers.next();
      setTimeout(() => list(controllers, opts, started), 300);
      return;
    }
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

function watch(controllers, opts, name) {
  if (!name) fail("watch needs a service name", 2);
  const ready = new Map(); // replica id -> status, kept up to date from snapshots and changes
  let call = null;
  let lostSince = null; // when the stream broke with no controller answering since
  const timer = setTimeout(() => {
    if (call) call.cancel();
    fail(`gave up after ${opts.timeout} s`, 5);
  }, opts.timeout * 1000);
  // A new leader starts its own sequence: follow it from a fresh snapshot.
  const follow = () => {
    call = controllers.current.WatchService({ service_name: name, after_sequence: 0 }, metadata());
    call.on("data", (msg) => onData(msg));
    call.on("error", (err) => {
      if (err.code === grpc.status.CANCELLED) return;
      lostSince = lostSince || Date.now();
      if (failover(err, controllers) && Date.now() - lostSince < FAILOVER_MS) {
        controllers.next();
        setTimeout(follow, 300);
        return;
      }
      clearTimeout(timer);
      fail(`${grpc.status[err.code]}: ${err.details}`, err.code === grpc.status.NOT_FOUND ? 3 : 1);
    });
    call.on("end", () => {
      clearTimeout(timer);
      process.exit(0);
    });
  };
  const onData = (msg) => {
    lostSince = null;
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
  };
  follow();
}

function main() {
  const opts = parseArgs(process.argv.slice(2));
  const controllers = new Controllers(loadController(), opts.controller);
  const [command, name] = opts.positional;
  if (command === "list") list(controllers, opts);
  else if (command === "watch") watch(controllers, opts, name);
  else fail("usage: client.js [--controller host:port[,host:port]] list | watch NAME [--until-ready N]", 2);
}

main();
