// The Greeting plugin in Node, with a fake parent and children: no cluster, no wasm.

import assert from 'node:assert/strict';
import { test } from 'node:test';

import type { KubeObject } from '@capstan/sdk';
import { render } from '@capstan/sdk/testing';
import { greeting } from '../src/greeting.js';

function parent(spec: Record<string, unknown>): KubeObject {
  return {
    apiVersion: 'example.com/v1',
    kind: 'Greeting',
    metadata: { name: 'hello', namespace: 'default', uid: 'uid-1', generation: 1 },
    spec,
  };
}

const observedConfigMap: KubeObject = {
  apiVersion: 'v1',
  kind: 'ConfigMap',
  metadata: { name: 'hello-greeting', namespace: 'default' },
};

test('a new Greeting asks for its ConfigMap and waits for it', () => {
  const out = render(greeting, parent({ message: 'Hello', audience: ['Alice', 'Bob'] }));
  assert.ok(out.ok);
  assert.deepEqual(out.desired.children, [
    {
      apiVersion: 'v1',
      kind: 'ConfigMap',
      metadata: { name: 'hello-greeting', labels: { 'example.com/greeting': 'hello' } },
      data: { 'greeting.txt': 'Hello, Alice!\nHello, Bob!\n' },
    },
  ]);
  assert.deepEqual(out.desired.status, { phase: 'Pending', configMap: 'hello-greeting', lines: 2 });
  assert.equal(out.desired.requeueAfterSeconds, 5);
  assert.equal(out.desired.events[0]?.reason, 'Greeting');
});

test('once the ConfigMap is observed the Greeting is Ready and nothing is requeued', () => {
  const out = render(greeting, parent({ message: 'Hi', shout: true }), [observedConfigMap]);
  assert.ok(out.ok);
  assert.deepEqual(out.desired.status, { phase: 'Ready', configMap: 'hello-greeting', lines: 1 });
  const data = out.desired.children[0]?.['data'] as Record<string, string> | undefined;
  assert.equal(data?.['greeting.txt'], 'HI, WORLD!\n');
  assert.equal(out.desired.requeueAfterSeconds, undefined);
  assert.deepEqual(out.desired.events, []);
  assert.equal(out.desired.conditions[0]?.status, 'true');
});

test('the same observed state gives the same desired state', () => {
  const spec = { message: 'Hello', audience: ['Alice'] };
  assert.deepEqual(render(greeting, parent(spec), [observedConfigMap]), render(greeting, parent(spec), [observedConfigMap]));
});

test('a wrong spec is one invalid line naming the field', () => {
  assert.deepEqual(render(greeting, parent({ audience: ['Alice'] })), {
    ok: false,
    error: { tag: 'invalid', val: 'spec.message: a non-empty string is required' },
  });
  assert.deepEqual(render(greeting, parent({ message: 'Hi', audience: 'Alice' })), {
    ok: false,
    error: { tag: 'invalid', val: 'spec.audience: must be a list of non-empty strings' },
  });
});
