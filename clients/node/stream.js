#!/usr/bin/env node
// Stream a completion from a tokenloop server.
//
// Uses @grpc/grpc-js with @grpc/proto-loader, which reads the repository's .proto at run time
// (no code generation). Field names are lowerCamelCase, as in grpcurl / buf curl JSON.
//
//   npm install
//   node stream.js "Tell me a joke" --max-new-tokens 64
//   node stream.js --chat "What is the capital of France?" --address 127.0.0.1:50051
//
// Text goes to stdout as it arrives; a summary line goes to stderr. Exit code 1 on a gRPC error,
// with the status code name and the server's message.
"use strict";

const path = require("node:path");
const { parseArgs } = require("node:util");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTO_ROOT = process.env.TOKENLOOP_PROTO_ROOT || path.join(__dirname, "..", "..", "protos");

function loadTokenloop() {
  const definition = protoLoader.loadSync("tokenloop/v1/tokenloop.proto", {
    includeDirs: [PROTO_ROOT],
    keepCase: false, // maxNewTokens, not max_new_tokens
    longs: String, // uint64 seed as a string: no precision lost
    enums: String, // finishReason: "EOS", not 2
    defaults: true,
    oneofs: true, // message.response === "chunk" | "complete"
  });
  return grpc.loadPackageDefinition(definition).tokenloop.v1;
}

function parse() {
  const { values, positionals } = parseArgs({
    allowPositionals: true,
    options: {
      address: { type: "string", default: process.env.TOKENLOOP_ADDRESS || "127.0.0.1:50051" },
      "api-key": { type: "string", default: process.env.TOKENLOOP_API_KEY },
      "max-new-tokens": { type: "string", default: "64" },
      temperature: { type: "string" },
      chat: { type: "boolean", default: false },
    },
  });
  if (positionals.length !== 1) {
    console.error('usage: node stream.js [--address HOST:PORT] [--max-new-tokens N] [--chat] "prompt"');
    process.exit(2);
  }
  return { ...values, prompt: positionals[0] };
}

function buildRequest(args) {
  const request = {
    stream: true,
    stopping: { maxNewTokens: Number(args["max-new-tokens"]) },
  };
  if (args.chat) request.chat = { messages: [{ role: "user", content: args.prompt }] };
  else request.text = args.prompt;
  if (args.temperature !== undefined) request.sampling = { temperature: Number(args.temperature) };
  return request;
}

function main() {
  const args = parse();
  const v1 = loadTokenloop();
  const client = new v1.TextGeneration(args.address, grpc.credentials.createInsecure());
  const metadata = new grpc.Metadata();
  if (args["api-key"]) metadata.set("authorization", `Bearer ${args["api-key"]}`);

  const call = client.Generate(buildRequest(args), metadata);
  call.on("data", (message) => {
    if (message.response === "chunk" && message.chunk.index === 0) {
      process.stdout.write(message.chunk.text);
    } else if (message.response === "complete") {
      const c = message.complete;
      process.stdout.write("\n");
      console.error(
        `[${c.finishReason} · ${c.usage.promptTokens} prompt + ${c.usage.completionTokens} completion tokens` +
          ` · ttft ${c.timing.ttftS.toFixed(3)}s · id ${message.requestId}]`,
      );
    }
  });
  call.on("error", (err) => {
    console.error(`error: ${grpc.status[err.code]}: ${err.details}`);
    process.exitCode = 1;
  });
  call.on("end", () => client.close());
}

main();
