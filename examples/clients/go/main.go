// Take a lock, renew it, pass its fence to a resource and release it, over
// fencelock's HTTP/JSON API with net/http.
//
//	FENCELOCK_URL=http://127.0.0.1:7420 go run . [LOCK_NAME]
//
// Set FENCELOCK_TOKEN when the server has tokens configured. Only the standard
// library: go.mod lists no modules. The program exits non-zero if anything
// differs from what the API promises (it runs in the project's tests against
// the real server).
package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"log"
	"net/http"
	"os"
	"time"
)

// Grant is the answer to an acquire: pass Fence to the resource with every write.
type Grant struct {
	Name       string `json:"name"`
	Fence      uint64 `json:"fence"`
	OwnerToken string `json:"owner_token"`
	TTLMs      uint64 `json:"ttl_ms"`
}

// Error is an error answer; Code is stable, branch on it.
type Error struct {
	Status  int
	Code    string `json:"code"`
	Message string `json:"message"`
}

func (e *Error) Error() string { return fmt.Sprintf("%d %s: %s", e.Status, e.Code, e.Message) }

// Client talks to one fencelock server.
type Client struct {
	URL   string
	Token string
	HTTP  *http.Client
}

func (c *Client) post(path string, body, answer any) error {
	payload, err := json.Marshal(body)
	if err != nil {
		return err
	}
	req, err := http.NewRequest(http.MethodPost, c.URL+path, bytes.NewReader(payload))
	if err != nil {
		return err
	}
	// Required of every body when authentication is off.
	req.Header.Set("Content-Type", "application/json")
	if c.Token != "" {
		req.Header.Set("Authorization", "Bearer "+c.Token)
	}
	resp, err := c.HTTP.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		var failure struct {
			Error Error `json:"error"`
		}
		if err := json.NewDecoder(resp.Body).Decode(&failure); err != nil {
			return fmt.Errorf("status %d: %w", resp.StatusCode, err)
		}
		failure.Error.Status = resp.StatusCode
		return &failure.Error
	}
	return json.NewDecoder(resp.Body).Decode(answer)
}

// Acquire takes the lock, waiting up to waitMs if it is held.
func (c *Client) Acquire(name string, ttlMs, waitMs uint64, owner string) (Grant, error) {
	var g Grant
	err := c.post("/v1/acquire", map[string]any{"name": name, "ttl_ms": ttlMs, "wait_ms": waitMs, "owner": owner}, &g)
	return g, err
}

// Renew extends the grant's lease; the fence stays.
func (c *Client) Renew(g Grant, ttlMs uint64) (Grant, error) {
	var r Grant
	err := c.post("/v1/renew", map[string]any{"name": g.Name, "owner_token": g.OwnerToken, "ttl_ms": ttlMs}, &r)
	r.OwnerToken = g.OwnerToken
	return r, err
}

// Release gives the lock up.
func (c *Client) Release(g Grant) error {
	var r struct {
		Released bool `json:"released"`
	}
	return c.post("/v1/release", map[string]any{"name": g.Name, "owner_token": g.OwnerToken}, &r)
}

// Resource accepts a write only if its fence is newer than the last one it
// accepted (in a database: one conditional UPDATE).
type Resource struct {
	lastFence uint64
	value     string
}

// Write stores value if fence is newer than the last fence accepted.
func (r *Resource) Write(fence uint64, value string) error {
	if fence <= r.lastFence {
		return fmt.Errorf("stale fence %d (last %d)", fence, r.lastFence)
	}
	r.lastFence, r.value = fence, value
	return nil
}

func main() {
	url := os.Getenv("FENCELOCK_URL")
	if url == "" {
		url = "http://127.0.0.1:7420"
	}
	name := "example:go"
	if len(os.Args) > 1 {
		name = os.Args[1]
	}
	c := &Client{URL: url, Token: os.Getenv("FENCELOCK_TOKEN"), HTTP: &http.Client{Timeout: 30 * time.Second}}
	var resource Resource

	first, err := c.Acquire(name, 10_000, 0, "go-example")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("acquired %s with fence %d\n", name, first.Fence)

	renewed, err := c.Renew(first, 20_000)
	if err != nil {
		log.Fatal(err)
	}
	if renewed.Fence != first.Fence {
		log.Fatalf("a renewal changed the fence: %d -> %d", first.Fence, renewed.Fence)
	}
	fmt.Printf("renewed for %d ms\n", renewed.TTLMs)

	// Pass the fence with every write.
	if err := resource.Write(first.Fence, "written by the first holder"); err != nil {
		log.Fatal(err)
	}

	// While it is held, another acquire is refused at once (or waits, with wait_ms).
	_, err = c.Acquire(name, 10_000, 0, "")
	var refused *Error
	if !errors.As(err, &refused) || refused.Status != http.StatusConflict || refused.Code != "held" {
		log.Fatalf("a held lock was not refused with 409 held: %v", err)
	}
	fmt.Printf("a second holder is refused: %s\n", refused.Code)

	if err := c.Release(first); err != nil {
		log.Fatal(err)
	}
	fmt.Println("released")

	// The next holder gets a larger fence, and the resource follows it...
	second, err := c.Acquire(name, 10_000, 0, "go-example-2")
	if err != nil {
		log.Fatal(err)
	}
	if second.Fence <= first.Fence {
		log.Fatalf("fences only grow: %d after %d", second.Fence, first.Fence)
	}
	if err := resource.Write(second.Fence, "written by the second holder"); err != nil {
		log.Fatal(err)
	}
	// ...so a late write by the first holder (paused past its lease, say) is refused.
	if err := resource.Write(first.Fence, "a late write"); err == nil {
		log.Fatal("the resource accepted a stale fence")
	} else {
		fmt.Printf("the resource refused a write with fence %d: %v\n", first.Fence, err)
	}
	if err := c.Release(second); err != nil {
		log.Fatal(err)
	}

	// A mistake gets a stable code: the body lacks the required name.
	err = c.post("/v1/acquire", map[string]any{"ttl_ms": 1000}, &Grant{})
	var invalid *Error
	if !errors.As(err, &invalid) || invalid.Status != http.StatusBadRequest || invalid.Code != "invalid_argument" {
		log.Fatalf("a body without a name was not refused with 400 invalid_argument: %v", err)
	}
	fmt.Println("ok")
}
